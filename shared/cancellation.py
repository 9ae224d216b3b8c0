"""Awaiting without losing a cancellation.

Python 3.11's `asyncio.wait_for` drops a cancellation that reaches it in the loop iteration in
which what it awaits completes: it returns the result instead (fixed in 3.12, gh-86296). A
service loop that waits on "wake now or at the next interval" is woken often, so a stop that
cancels it could leave it running on (the migrate-out loop did, hanging a test run; the load
reporter could go on publishing after its instance said it left). So every timed wait here goes
through `asyncio.timeout`, which delivers the cancellation to the task itself: `wait_set` for an
event. Where a library waits with `wait_for` inside (nats-py's `request`), `keeping_cancellation`
raises the cancellation it swallowed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_set(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until `event` is set or `timeout_s` passed (None: no limit); True if it is set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()


async def keeping_cancellation(awaitable: Awaitable[T]) -> T:
    """`await awaitable`, raising CancelledError if this task was cancelled meanwhile and the
    awaitable returned anyway (the task still counts the request: `Task.cancelling`)."""
    task = asyncio.current_task()
    cancels = task.cancelling() if task is not None else 0
    result = await awaitable
    if task is not None and task.cancelling() > cancels:
        raise asyncio.CancelledError()
    return result
