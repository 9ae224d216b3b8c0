"""Waiting in a test for a condition that another task or process brings about: the one polling
loop the suites share (a harness's own condition wait, like `NatsObserver.wait_for`, builds on
what it watches, not on this)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def poll(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.005) -> bool:
    """True as soon as `predicate()` holds, False once `timeout_s` passed without it (it is asked
    once more at the deadline, so a slow turn of the loop does not lose the last look)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 2.0, interval_s: float = 0.005,
                     what: str = "condition not met in time") -> None:
    """`poll`, failing the test with `what` when the condition does not come."""
    assert await poll(predicate, timeout_s, interval_s), f"{what} (within {timeout_s} s)"
