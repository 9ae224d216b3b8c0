"""The gateway's view of the instances, built from the load reports it overhears.

Load reports double as heartbeats: an instance silent for `timeout_s` is dead (or sooner, silent
while the others report: `silent_for` against a limit that grows for an instance whose reports
came late lately, `shared.silence`). The gateway needs
them for bypass dispatch (when the global scheduler does not answer) and for the watchdog that
fails requests whose holder died. Storage and expiry are the scheduler's own table.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.instance_table import InstanceTable
from shared.messages import DispatchRequest, LoadReport
from shared.policy import account_dispatch
from shared.silence import SilenceLimits
from shared.unreported_dispatches import UnreportedDispatches


class GatewayInstances:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        assert timeout_s > 0
        self.timeout_s = timeout_s
        self._clock = clock
        self._table = InstanceTable(timeout_s, clock)
        self._unreported = UnreportedDispatches(clock)  # our own dispatches its reports do not show yet
        self._marked_dead: dict[str, float] = {}  # instance id -> when; until it reports again
        self._heard: dict[str, float] = {}  # instance id -> when its last report arrived
        self._latest = float("-inf")  # when the last report of any instance arrived
        self._limits = SilenceLimits(clock)

    def update(self, load: LoadReport) -> None:
        if not self._table.takes(load):  # (a reordered older one is dropped)
            return
        self._table.update(self._unreported.restore(load))
        self._marked_dead.pop(load.instance_id, None)
        self._heard[load.instance_id] = self._latest = self._clock()
        self._limits.heard(load.instance_id)

    def death_limit_s(self, instance_id: str, base_s: float) -> float:
        """How long `silent_for` must say before the instance is dead: `base_s`, or longer for one
        whose reports came late lately (starved, not dead), never past `timeout_s`."""
        return self._limits.limit(instance_id, base_s, max(base_s, self.timeout_s))

    def silent_for(self, instance_id: str, since: float) -> float:
        """How long the instance has been silent while others were heard: from its last report
        (or `since`, if later) to the latest report of any instance; infinite once marked dead.

        Relative, so that a gateway too busy to read its reports for a while (or a bus that
        delivers them late) does not take every instance for dead at once: their reports then
        arrive late together. A lone instance's silence is left to `is_silent`."""
        if instance_id in self._marked_dead:
            return float("inf")
        return self._latest - max(since, self._heard.get(instance_id, since))

    def mark_dead(self, instance_id: str) -> None:
        """Declare an instance dead at once (nobody listens on its subjects any more)."""
        self._table.remove(instance_id)
        self._marked_dead[instance_id] = self._clock()
        self._limits.forget(instance_id)  # (should it report again, judged afresh)

    def live_loads(self) -> list[LoadReport]:
        return self._table.live()

    def alive_count(self) -> int:
        return len(self._table.live())

    def is_silent(self, instance_id: str, since: float) -> bool:
        """Dead, as far as this gateway can tell: marked dead, or not heard from for `timeout_s`
        counting from `since` (when we started relying on it, so that an instance is not declared
        dead before it had time to send its first report)."""
        if instance_id in self._marked_dead:
            return True
        self._table.expire()
        if self._table.get(instance_id) is not None:
            return False
        return self._clock() - since > self.timeout_s

    def account(self, instance_id: str, request: DispatchRequest) -> None:
        """Count a request we dispatched ourselves until the instance's next report includes it."""
        load = self._table.get(instance_id)
        if load is not None:
            self._unreported.dispatched(load, request)
            self._table.replace_load(account_dispatch(load, request))

    def prefix_block_size(self) -> int | None:
        """The KV block size most live instances report (prompt hashes are cut at it); None when
        no instance reports. Instances with another size simply match nothing."""
        sizes: dict[int, int] = {}
        for load in self._table.live():
            sizes[load.block_size] = sizes.get(load.block_size, 0) + 1
        return max(sizes, key=lambda size: (sizes[size], -size)) if sizes else None

    def max_model_len(self, instance_id: str) -> int | None:
        load = self._table.get(instance_id)
        return load.max_model_len if load is not None and load.max_model_len > 0 else None

    def smallest_max_model_len(self) -> int | None:
        """The shortest context over live instances (those that report one); None when none does."""
        limits = [load.max_model_len for load in self._table.live() if load.max_model_len > 0]
        return min(limits) if limits else None

    def forget_marks(self, older_than_s: float) -> None:
        """Drop dead-marks of instances gone for good (the table expires its own entries)."""
        now = self._clock()
        for instance_id in [i for i, t in self._marked_dead.items() if now - t > older_than_s]:
            del self._marked_dead[instance_id]
        for instance_id in [i for i, t in self._heard.items() if now - t > older_than_s]:
            del self._heard[instance_id]
            self._limits.forget(instance_id)
            self._unreported.forget(instance_id)
