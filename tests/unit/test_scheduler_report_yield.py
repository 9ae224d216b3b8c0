"""The scheduler's report handling gives way to dispatch: nats-py runs a subscription's backlog
back to back, so without a yield now and then a burst of reports would hold every dispatch
waiting behind it (benchmarks/control_plane.py measures the effect at 1,000 instances)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.global_scheduler import service as service_module
from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.service import GlobalScheduler
from shared.messages import encode
from tests.unit.policy_helpers import make_load


async def test_a_backlog_of_reports_lets_other_work_in_every_few_reports() -> None:
    scheduler = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    reports = [SimpleNamespace(data=encode(make_load(f"i{k}")), subject=f"corral.load.i{k}") for k in range(64)]
    handled_when_let_in: list[int] = []

    async def backlog() -> None:  # what nats-py's subscription task does with a full queue
        for msg in reports:
            await scheduler._on_report(msg)

    async def dispatch_waiting() -> None:
        handled_when_let_in.append(len(scheduler.table))

    drain = asyncio.ensure_future(backlog())
    other = asyncio.ensure_future(dispatch_waiting())
    await asyncio.gather(drain, other)
    assert len(scheduler.table) == 64
    assert handled_when_let_in and handled_when_let_in[0] <= service_module.REPORTS_PER_YIELD
