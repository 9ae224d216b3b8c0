"""Where a request here has been before, and when it left: the return-trip limit's memory.

The record travels with the request in its `MigrationCommit` (instance id -> wall-clock time it
left; wall clock, since it crosses hosts), so a source can tell whether the destination it is
paired with is one the request left less than `MigrationGuard.min_return_s` ago (`may_move`,
the rule the simulator runs).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

_MAX_TRACKED = 65536  # requests that finished here leave their record behind; the oldest go first


class Departures:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._by_request: collections.OrderedDict[str, dict[str, float]] = collections.OrderedDict()

    def arrived(self, request_id: str, departures: dict[str, float]) -> None:
        """A request migrated in, carrying where it had been."""
        if departures:
            self._by_request[request_id] = dict(departures)
            self._by_request.move_to_end(request_id)
            while len(self._by_request) > _MAX_TRACKED:
                self._by_request.popitem(last=False)

    def left_s_ago(self, request_id: str, instance_id: str) -> float | None:
        """How long ago the request left `instance_id`; None if it never was there."""
        left = self._by_request.get(request_id, {}).get(instance_id)
        return None if left is None else self._clock() - left

    def leaving(self, request_id: str, instance_id: str) -> dict[str, float]:
        """The record its commit carries when it leaves `instance_id` now."""
        return {**self._by_request.get(request_id, {}), instance_id: self._clock()}

    def forget(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)
