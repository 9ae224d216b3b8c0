"""Run one service in this process until SIGINT/SIGTERM, then stop it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol

from services.stop_phases import pending_task_stacks

log = logging.getLogger(__name__)


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_until_signalled(service: Service, wait: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start, wait for a signal (or for `wait()` to return, e.g. a crashed loop), then stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # `kill -USR1 PID` writes every thread's stack to stderr: how a hung service says where.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # `kill -USR2 PID` logs where each of the event loop's tasks waits.
    loop.add_signal_handler(signal.SIGUSR2, lambda: log.warning("tasks now:\n%s", pending_task_stacks()))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if not await _start_unless_signalled(service, stop):
        log.info("signalled while starting: stopping")
        await service.stop()
        return
    waiters = [asyncio.create_task(stop.wait())]
    if wait is not None:
        waiters.append(asyncio.create_task(wait()))
    try:
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waiters:
            task.cancel()
        await service.stop()
        log.info("stopped")
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()


async def _start_unless_signalled(service: Service, stop: asyncio.Event) -> bool:
    """Start the service; give up (False) if a signal comes first. A start can wait a long time
    (an engine loading a model, a NATS server that is not there yet), and an operator's Ctrl-C or
    SIGTERM must not wait for it."""
    starting = asyncio.create_task(service.start())
    signalled = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
    finally:
        signalled.cancel()
    if starting.done():
        starting.result()  # a failed start raises here
        return True
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting
    return False


def run(main: Awaitable[None]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(main)
        return
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main)
