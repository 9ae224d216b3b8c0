"""The scheduler's view of the cluster: the latest load report of every live instance."""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.messages import LoadReport


@dataclass
class _Entry:
    report: LoadReport
    last_seen: float


class InstanceTable:
    """Instances that stop reporting for `timeout_s` drop out; the table holds no per-request state."""

    def __init__(self, timeout_s: float, clock=time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def update(self, report: LoadReport) -> bool:
        """Store a report; False if it is older than what we have (reordered delivery)."""
        entry = self._entries.get(report.instance_id)
        if entry is not None and report.seq <= entry.report.seq and report.seq > 1:
            return False
        self._entries[report.instance_id] = _Entry(report, self._clock())
        return True

    def replace_load(self, report: LoadReport) -> None:
        """Local bookkeeping between reports (a dispatch we just made), keeping the seq."""
        entry = self._entries.get(report.instance_id)
        if entry is not None:
            entry.report = report

    def expire(self) -> list[str]:
        now = self._clock()
        dead = [iid for iid, e in self._entries.items() if now - e.last_seen > self.timeout_s]
        for iid in dead:
            del self._entries[iid]
        return dead

    def remove(self, instance_id: str) -> None:
        self._entries.pop(instance_id, None)

    def live(self) -> list[LoadReport]:
        self.expire()
        return [e.report for e in self._entries.values()]

    def get(self, instance_id: str) -> LoadReport | None:
        entry = self._entries.get(instance_id)
        return entry.report if entry else None

    def __len__(self) -> int:
        return len(self._entries)
