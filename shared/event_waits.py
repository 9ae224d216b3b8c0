"""Waiting for an `asyncio.Event` with a timeout, without losing a cancellation.

Python 3.11's `asyncio.wait_for` drops a cancellation that reaches it in the loop iteration in
which the awaited event is set (it returns the result instead; fixed in 3.12, gh-86296). A
service loop that waits on "wake now or at the next interval" is set often, so a stop that
cancels it could leave it running on: the llumlet's load reporter publishing after the instance
said it left, a migration coordinator still pairing. `asyncio.timeout` delivers the
cancellation to the task itself and has no such window; every timed wait in the services goes
through it."""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until `event` is set or `timeout_s` passed (None: no limit); True if it is set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()
