"""The scheduler's view of the cluster: the latest load report of every live instance."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from shared.messages import LoadReport


@dataclass
class _Entry:
    report: LoadReport
    last_seen: float


class LoadListener(Protocol):
    """Kept in step with the table (the scheduler's `DispatchIndex`)."""

    def put(self, load: LoadReport) -> None: ...

    def remove(self, instance_id: str) -> None: ...


class InstanceTable:
    """Instances that stop reporting for `timeout_s` drop out; the table holds no per-request state.

    `listener` (and any added later) sees every load stored and every instance dropped. Expiry
    costs O(instances dropped), not a scan: entries are also kept in the order they were last seen."""

    def __init__(self, timeout_s: float, clock=time.monotonic, listener: LoadListener | None = None) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._listeners: list[LoadListener] = [listener] if listener is not None else []
        self._entries: dict[str, _Entry] = {}  # in order of arrival: the order `live()` lists them
        self._by_seen: OrderedDict[str, None] = OrderedDict()  # least recently seen first

    def takes(self, report: LoadReport) -> bool:
        """Whether `update` stores it: not older than what we have (reordered delivery); a seq of
        1 is an instance that restarted."""
        entry = self._entries.get(report.instance_id)
        return entry is None or report.seq > entry.report.seq or report.seq <= 1

    def update(self, report: LoadReport) -> bool:
        """Store a report; False if it is older than what we have (reordered delivery)."""
        if not self.takes(report):
            return False
        self._entries[report.instance_id] = _Entry(report, self._clock())
        self._by_seen[report.instance_id] = None
        self._by_seen.move_to_end(report.instance_id)
        for listener in self._listeners:
            listener.put(report)
        return True

    def add_listener(self, listener: LoadListener) -> None:
        """Kept in step from now on, starting with every load held."""
        self._listeners.append(listener)
        for entry in self._entries.values():
            listener.put(entry.report)

    def replace_load(self, report: LoadReport) -> None:
        """Local bookkeeping between reports (a dispatch we just made), keeping the seq."""
        entry = self._entries.get(report.instance_id)
        if entry is not None:
            entry.report = report
            for listener in self._listeners:
                listener.put(report)

    def expire(self) -> list[str]:
        now = self._clock()
        dead = []
        for iid in self._by_seen:
            if now - self._entries[iid].last_seen <= self.timeout_s:
                break
            dead.append(iid)
        for iid in dead:
            self.remove(iid)
        return dead

    def remove(self, instance_id: str) -> None:
        if self._entries.pop(instance_id, None) is not None:
            del self._by_seen[instance_id]
            for listener in self._listeners:
                listener.remove(instance_id)

    def live(self) -> list[LoadReport]:
        self.expire()
        return [e.report for e in self._entries.values()]

    def get(self, instance_id: str) -> LoadReport | None:
        entry = self._entries.get(instance_id)
        return entry.report if entry else None

    def __len__(self) -> int:
        return len(self._entries)
