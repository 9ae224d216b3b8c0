"""Dispatch without scoring every instance per request: `choose_instance`'s answer from loads kept
sorted by their dispatch score, re-scored only when an instance's load changes (a report, a dispatch).

The policy stays `shared.policy.dispatch` (scores, filters, tie-break, rejections): this module
only orders its inputs. `DispatchIndex.choose(request)` equals `choose_instance(loads, request,
config)` over the loads in the order they were first put (tests/unit/test_dispatch_index.py
checks it against the scan on random tables). A request walks the ranking from the top, past the
instances it excludes or does not fit, and stops at the first one below the tie band: O(log N)
per load change and O(ties + skipped) per request, instead of O(N) per request.
"""

from __future__ import annotations

import itertools

from sortedcontainers import SortedList

from shared.messages import DispatchRequest, LoadReport
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import (
    REJECT_NO_INSTANCE, REJECT_OVERLOADED, REJECT_TOO_LONG, DispatchDecision, dispatch_score, fits_model, pick_tied,
)
from shared.policy.freeness import QueueDemand, freeness
from shared.messages import Refusal

# A ranking key: (-score, arrival order, instance id). Ascending = best first; equal scores in
# arrival order, as `max` over the scan's list keeps the first of equals.
_Key = tuple[float, int, str]


class DispatchIndex:
    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._arrival = itertools.count()
        self._loads: dict[str, LoadReport] = {}
        self._keys: dict[str, _Key] = {}
        self._serving: SortedList = SortedList()  # instances not draining
        self._draining: SortedList = SortedList()

    def __len__(self) -> int:
        return len(self._loads)

    def put(self, load: LoadReport, order: int | None = None) -> None:
        """An instance's new load (a report, or a dispatch accounted): re-ranked in O(log N).

        `order`: the instance's place in the scan's list, when the caller keeps one (the simulator
        lists instances as they started serving, which is not always the order of their first
        report); by default, the order first put. It is read when the instance is first put."""
        old = self._keys.get(load.instance_id)
        neg_score = -dispatch_score(load, self.config.headroom_blocks)
        if old is None:
            arrival = next(self._arrival) if order is None else order
        else:
            previous = self._loads[load.instance_id]
            if old[0] == neg_score and previous.draining == load.draining:
                self._loads[load.instance_id] = load  # same rank (a heartbeat, a small change): no re-sort
                return
            arrival = old[1]
            self._ranking(previous).remove(old)
        key = (neg_score, arrival, load.instance_id)
        self._keys[load.instance_id] = key
        self._loads[load.instance_id] = load
        self._ranking(load).add(key)

    def remove(self, instance_id: str) -> None:
        key = self._keys.pop(instance_id, None)
        if key is not None:
            self._ranking(self._loads.pop(instance_id)).remove(key)

    def _ranking(self, load: LoadReport) -> SortedList:
        return self._draining if load.draining else self._serving

    def choose(self, request: DispatchRequest) -> DispatchDecision:
        """`choose_instance` over the loads put here, in their arrival order."""
        excluded = set(request.exclude)
        for ranking in (self._serving, self._draining):  # draining ones only when no other may take it
            best: LoadReport | None = None
            floor = 0.0
            tied: list[str] = []
            for neg_score, _arrival, instance_id in ranking:
                load = self._loads[instance_id]
                if instance_id in excluded or not fits_model(load, request):
                    continue
                if best is None:
                    best, floor = load, -neg_score - self.config.tie_epsilon
                elif -neg_score < floor:
                    break
                tied.append(instance_id)
            if best is not None:
                threshold = self.config.reject_below_freeness
                if threshold is not None and freeness(best, self.config.headroom_blocks, QueueDemand.ALL) < threshold:
                    return DispatchDecision(None, REJECT_OVERLOADED, Refusal.OVERLOADED)
                return DispatchDecision(pick_tied(tied, request))
        if self._loads and not any(fits_model(load, request) for load in self._loads.values()):
            return DispatchDecision(None, REJECT_TOO_LONG, Refusal.TOO_LONG)
        return DispatchDecision(None, REJECT_NO_INSTANCE, Refusal.NO_INSTANCE)

    def loads_in_arrival_order(self) -> list[LoadReport]:
        """What the scan would be given (for tests and tools)."""
        return [self._loads[iid] for iid in sorted(self._loads, key=lambda iid: self._keys[iid][1])]
