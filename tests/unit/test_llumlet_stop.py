"""A llumlet that stops announces it: its last load report says draining, so dispatch moves on
at once instead of after the instance timeout; and every report says who made it drain."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import nats
from nats.aio.client import Client

from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.service import Llumlet
from shared import subjects
from shared.messages import Ack, DrainOrder, DrainSource, LoadReport, decode, encode
from shared.nats_client import flush_in_order
from tests.unit.migration_helpers import sim_config


@contextlib.asynccontextmanager
async def reporting_llumlet(nats_url: str, prefix: str) -> AsyncIterator[tuple[Llumlet, Client, list[LoadReport]]]:
    """A started llumlet, a client and the llumlet's load reports as they arrive. The caller
    stops the llumlet; every report it sent is in the list once this exits."""
    instance_id = f"{prefix}-{uuid.uuid4().hex[:6]}"
    reports: list[LoadReport] = []
    nc = await nats.connect(nats_url)

    async def on_report(msg) -> None:
        reports.append(decode(msg.data, LoadReport))

    await nc.subscribe(subjects.load_report(instance_id), cb=on_report)
    llumlet = Llumlet(LlumletConfig(instance_id, nats_url, report_interval_s=0.05), SimEngine(sim_config()))
    await llumlet.start()
    try:
        yield llumlet, nc, reports
    finally:
        if llumlet.nc is not None and not llumlet.nc.is_closed:
            await llumlet.stop()
        await flush_in_order(nc)
        await nc.close()


async def test_the_last_report_of_a_stopping_llumlet_says_draining(nats_url):
    async with reporting_llumlet(nats_url, "stop") as (llumlet, _, reports):
        await llumlet.stop()
    assert reports and not reports[0].draining
    assert reports[-1].draining


async def test_reports_say_who_made_the_llumlet_drain(nats_url):
    async with reporting_llumlet(nats_url, "drain") as (llumlet, nc, reports):
        await flush_in_order(llumlet.nc)
        drain = subjects.llumlet(llumlet.instance_id, "drain")

        async def ordered(order: DrainOrder) -> LoadReport:
            assert decode((await nc.request(drain, encode(order), timeout=2)).data, Ack).ok
            seen = len(reports)
            while len(reports) == seen:
                await asyncio.sleep(0.01)
            return reports[-1]

        by_autoscaler = await ordered(DrainOrder(drain=True, by=DrainSource.AUTOSCALER))
        assert by_autoscaler.draining and by_autoscaler.drained_by is DrainSource.AUTOSCALER
        undrained = await ordered(DrainOrder(drain=False))
        assert not undrained.draining and undrained.drained_by is None
        by_operator = await ordered(DrainOrder())  # `corral drain`'s order
        assert by_operator.drained_by is DrainSource.OPERATOR
        await llumlet.stop()
    assert reports[-1].drained_by is DrainSource.OPERATOR  # its own stop keeps the operator's mark


async def test_a_stop_without_a_drain_order_reports_itself_as_the_reason(nats_url):
    async with reporting_llumlet(nats_url, "stopby") as (llumlet, _, reports):
        await llumlet.stop()
    assert reports[0].drained_by is None and reports[-1].drained_by is DrainSource.STOPPING
