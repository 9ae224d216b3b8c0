"""A service's stop, phase by phase: each phase bounded and timed, so a stop that hangs says
where it hangs (with the stacks of the tasks still pending) and the process still exits.

An orchestrator's grace period (Kubernetes' terminationGracePeriodSeconds, `corral up`'s) is the
last word on a stop; a phase that waits past its bound only makes that end a SIGKILL, with
nothing said about why."""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Awaitable

SLOW_S = 1.0  # a phase that took longer is logged even when it finished


class StopPhases:
    def __init__(self, service: str, log: logging.Logger) -> None:
        self.service = service
        self.log = log

    async def run(self, phase: str, step: Awaitable[object], timeout_s: float) -> bool:
        """Await `step` for at most `timeout_s` (then it is cancelled); True if it finished.
        A phase that fails or overruns is logged and the stop goes on with the next."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                await step
        except TimeoutError:
            self.log.error("%s stopping: %s did not finish within %.1f s; going on without it. Pending:\n%s",
                           self.service, phase, timeout_s, pending_task_stacks())
            return False
        except Exception as exc:  # a stop goes on: what is left still needs its turn
            self.log.warning("%s stopping: %s failed: %r", self.service, phase, exc)
            return False
        took = time.monotonic() - started
        if took > SLOW_S:
            self.log.info("%s stopping: %s took %.1f s", self.service, phase, took)
        return True


def pending_task_stacks(limit: int = 30) -> str:
    """Where each task of the running loop waits (its coroutine stack), for a stop's log."""
    out = io.StringIO()
    current = asyncio.current_task()
    for task in list(asyncio.all_tasks())[:limit]:
        if task is not current:
            task.print_stack(limit=6, file=out)
    return out.getvalue()
