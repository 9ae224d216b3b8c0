"""The event queue of the discrete-event loop: (virtual time, insertion order, handler, payload).

Events at the same time run in the order they were scheduled, so a run is a pure function of
its inputs. Handlers are plain callables: the loop pops an event and calls `handler(payload)`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

Handler = Callable[[Any], None]


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Handler, Any]] = []
        self._order = itertools.count()

    def push(self, time_s: float, handler: Handler, payload: Any = None) -> None:
        heapq.heappush(self._heap, (time_s, next(self._order), handler, payload))

    def pop(self) -> tuple[float, Handler, Any]:
        time_s, _, handler, payload = heapq.heappop(self._heap)
        return time_s, handler, payload

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
