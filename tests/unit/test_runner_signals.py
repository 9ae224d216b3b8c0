"""A running service logs its event loop's tasks on SIGUSR2 and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from services.runner import serve_until_signalled


class _Service:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.stopped = False

    async def start(self) -> None:
        self.started.set()

    async def stop(self) -> None:
        self.stopped = True


async def test_sigusr2_logs_pending_tasks_and_sigterm_stops(caplog):
    service = _Service()

    async def parked_somewhere_recognisable() -> None:
        await asyncio.Event().wait()

    parked = asyncio.create_task(parked_somewhere_recognisable())
    with caplog.at_level(logging.INFO, logger="services.runner"):
        serving = asyncio.create_task(serve_until_signalled(service))
        await asyncio.wait_for(service.started.wait(), 5)
        await asyncio.sleep(0)  # the serve task now waits for a signal
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(50):
            if "tasks now:" in caplog.text:
                break
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 5)
    parked.cancel()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGUSR2, signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    assert "tasks now:" in caplog.text
    assert "parked_somewhere_recognisable" in caplog.text
    assert service.stopped
    assert "stopped" in caplog.text
