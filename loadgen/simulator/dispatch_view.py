"""Freeness dispatch in the simulator through the live scheduler's `DispatchIndex`: the same rule
at the same cost, O(log N) per load change instead of scoring every instance per arrival.

The plain path (`ClusterSimulator.loads()` then `choose_instance`) refreshes, at each arrival,
every serving instance's report that has aged past the report interval, and scans them all. This
view keeps the index equal to what that scan would be given at the same moment:

- every report an instance builds (`SimInstance.on_report`) and every dispatch accounted on it is
  put, at its place in the serving list (the order the instance started serving, which is the
  order `choose_instance` keeps the first of equal scores in);
- reports are remembered in the order they were built (virtual time only grows), so the ones that
  have aged out are found from the front without looking at the fresh ones;
- an instance that starts serving before it ever reported waits for the next dispatch, which
  builds its report exactly when the scan would have.

tests/simulator/test_dispatch_view.py checks the decisions equal the plain path's on seeded
workloads (migration, priorities, auto-scaling with drains, early rejection by freeness).
"""

from __future__ import annotations

import itertools
from collections import deque

from loadgen.simulator.instance import InstanceState, SimInstance
from shared.messages import DispatchRequest
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import DispatchDecision
from shared.policy.dispatch_index import DispatchIndex


class IndexedDispatch:
    def __init__(self, config: PolicyConfig, report_interval_s: float, max_model_len: int) -> None:
        self.index = DispatchIndex(config)
        self._interval = report_interval_s
        self._max_model_len = max_model_len
        self._place: dict[str, int] = {}  # serving instance -> its place in the serving list
        self._places = itertools.count()
        self._unreported: list[SimInstance] = []  # started serving, not yet put
        self._built: deque[tuple[float, SimInstance]] = deque()  # (built at, instance), oldest first

    @property
    def queued_reports(self) -> int:
        """Reports remembered for their age (about one per instance)."""
        return len(self._built)

    # -- told by the cluster -------------------------------------------------------------------

    def joined(self, instance: SimInstance) -> None:
        """The instance started serving (it is appended to the serving list)."""
        assert instance.instance_id not in self._place, instance.instance_id
        self._place[instance.instance_id] = next(self._places)
        self._unreported.append(instance)

    def left(self, instance: SimInstance) -> None:
        """The instance stopped serving."""
        del self._place[instance.instance_id]
        self.index.remove(instance.instance_id)

    def reported(self, instance: SimInstance) -> None:
        """The instance built a report (any builder: dispatch, a migration round, the autoscaler)."""
        built = self._built
        built.append((instance.report_at, instance))
        # Entries superseded by a later report (which has an entry behind them) or of a stopped
        # instance go from the front as they come, so the queue stays about one entry per instance
        # even while no dispatch reads it (after the last arrival every migration round reports).
        while built and (built[0][1].report_at != built[0][0] or built[0][1].state is InstanceState.STOPPED):
            built.popleft()
        self.accounted(instance)

    def accounted(self, instance: SimInstance) -> None:
        """`instance.report` changed without a new report (a dispatch accounted on it)."""
        place = self._place.get(instance.instance_id)
        if place is not None:
            self.index.put(instance.report, order=place)

    # -- dispatch --------------------------------------------------------------------------------

    def choose(self, now: float, request: DispatchRequest) -> DispatchDecision:
        """`choose_instance(cluster.loads(), request, config)`, as of `now`."""
        self._refresh(now)
        return self.index.choose(request)

    def _refresh(self, now: float) -> None:
        """Build the reports the scan would build now: the serving instances' aged-out ones, and
        those of instances that never reported."""
        interval, built = self._interval, self._built
        due: dict[str, SimInstance] = {}
        while built and now - built[0][0] >= interval:
            at, instance = built.popleft()
            # (older entries of an instance that reported again since are skipped)
            if instance.report_at == at and instance.instance_id in self._place:
                due[instance.instance_id] = instance
        unreported, self._unreported = self._unreported, []
        for instance in unreported:
            if instance.instance_id not in self._place:
                continue
            if instance.report is None or now - instance.report_at >= interval:
                due[instance.instance_id] = instance
            else:  # reported before it started serving, still fresh
                self.accounted(instance)
        for instance in due.values():
            instance.build_report(now, self._max_model_len)  # puts it (`reported`)
