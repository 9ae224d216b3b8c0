"""Which scheduler replica pairs migrations: the live one with the lowest id.

Every replica answers dispatch (a NATS queue group) from its own full load table, but migration
orders must come from one of them: two pairers would re-point each other's sources every round.
Each replica publishes a heartbeat on `subjects.SCHEDULER_HEARTBEAT`; a replica leads when no
live replica has a lower id. A new replica waits one lease before it may lead, so it has heard
every live peer first (no two leaders while it joins); a leader that hears a lower id steps down
at once. When the leader dies its heartbeats stop and the next-lowest leads one lease later; the
dead leader's pairs lapse at their sources meanwhile (a pair lives only while re-confirmed).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Leadership:
    def __init__(self, my_id: str, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        assert lease_s > 0, lease_s
        self.my_id = my_id
        self.lease_s = lease_s
        self._clock = clock
        self._joined = clock()
        self._heard: dict[str, float] = {}  # peer id -> when its last heartbeat arrived

    def heard(self, scheduler_id: str) -> None:
        if scheduler_id != self.my_id:
            self._heard[scheduler_id] = self._clock()

    def live_peers(self) -> list[str]:
        now = self._clock()
        for peer in [p for p, at in self._heard.items() if now - at > self.lease_s]:
            del self._heard[peer]
        return sorted(self._heard)

    def leader(self) -> str:
        """The replica that should pair now, as far as this one knows."""
        return min([self.my_id, *self.live_peers()])

    def leads(self) -> bool:
        return self._clock() - self._joined >= self.lease_s and self.leader() == self.my_id
