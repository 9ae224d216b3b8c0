"""A llumlet that stops announces it: its last load report says draining, so dispatch moves on
at once instead of after the instance timeout."""

from __future__ import annotations

import uuid

import nats

from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.service import Llumlet
from shared import subjects
from shared.messages import LoadReport, decode
from shared.nats_client import flush_in_order
from tests.unit.migration_helpers import sim_config


async def test_the_last_report_of_a_stopping_llumlet_says_draining(nats_url):
    instance_id = f"stop-{uuid.uuid4().hex[:6]}"
    reports: list[LoadReport] = []
    nc = await nats.connect(nats_url)

    async def on_report(msg) -> None:
        reports.append(decode(msg.data, LoadReport))

    await nc.subscribe(subjects.load_report(instance_id), cb=on_report)
    llumlet = Llumlet(LlumletConfig(instance_id, nats_url, report_interval_s=0.05), SimEngine(sim_config()))
    await llumlet.start()
    await llumlet.stop()
    await flush_in_order(nc)
    await nc.close()
    assert reports and not reports[0].draining
    assert reports[-1].draining
