"""A circuit breaker in front of the global scheduler.

A scheduler that is alive but not answering (frozen, overloaded, partitioned) would cost every
request the full dispatch timeout. After one timeout the breaker opens: requests dispatch from
this gateway's own load reports (bypass) without asking. After `open_s` one request probes the
scheduler again (the others keep bypassing meanwhile); an answer closes the breaker, another
timeout re-opens it for twice as long (up to `max_open_s`), so a scheduler frozen for good costs
one timeout per `max_open_s`, not one per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SchedulerBreaker:
    def __init__(self, open_s: float = 1.0, max_open_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert 0 < open_s <= max_open_s, (open_s, max_open_s)
        self._base_open_s = open_s
        self._max_open_s = max_open_s
        self._clock = clock
        self._open_s = open_s
        self._open_until: float | None = None  # None: closed
        self._probing = False  # half-open: one request is asking

    @property
    def closed(self) -> bool:
        return self._open_until is None

    def may_ask(self) -> bool:
        """Ask the scheduler for this request? Always while closed; once open, only the one
        probe after `open_s` (each caller that gets True must report `answered` or `failed`)."""
        if self._open_until is None:
            return True
        if self._probing or self._clock() < self._open_until:
            return False
        self._probing = True
        return True

    def answered(self) -> None:
        self._open_until = None
        self._probing = False
        self._open_s = self._base_open_s

    def abandoned(self) -> None:
        """A request gave up before the scheduler answered (its client left): no verdict."""
        self._probing = False

    def failed(self) -> None:
        """The scheduler did not answer in time (or answered garbage): open, or stay open longer."""
        if self._open_until is not None and self._probing:
            self._open_s = min(self._open_s * 2, self._max_open_s)
        self._probing = False
        self._open_until = self._clock() + self._open_s
