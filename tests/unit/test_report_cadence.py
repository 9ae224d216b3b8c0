"""Load reports only on change, with a heartbeat (issue 17 §3): the rule, and a live llumlet's
reports as a subscriber on its real subject sees them."""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import nats
import pytest

from services.llumlet.config import LlumletConfig, add_arguments, config_from_args
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.service import Llumlet
from shared import subjects
from shared.engine_model.load_report import aggregate_views, build_load_report
from shared.engine_model.report_cadence import blocks_moved, report_due, says_the_same
from shared.messages import LoadReport, decode
from tests.unit.migration_helpers import gen, sim_config


def report(seq: int = 1, sent_at: float = 100.0, free: int = 10, accepted: int = 0) -> LoadReport:
    return build_load_report(instance_id="i", seq=seq, sent_at=sent_at, requests=aggregate_views([]),
                             num_blocks_total=10, num_blocks_free=free, block_size=16, num_preemptions_total=0,
                             headroom_blocks=None, num_accepted_total=accepted)


def test_a_step_that_moved_a_share_of_the_blocks_is_reported_at_once():
    last = build_load_report(instance_id="i", seq=1, sent_at=1.0, requests=aggregate_views([]), num_blocks_total=1000,
                             num_blocks_free=600, block_size=16, num_preemptions_total=0, headroom_blocks=None)
    assert blocks_moved(None, 600, 1000, 0.05)  # (nothing reported yet)
    assert not blocks_moved(last, 649, 1000, 0.05) and not blocks_moved(last, 551, 1000, 0.05)
    assert blocks_moved(last, 650, 1000, 0.05) and blocks_moved(last, 550, 1000, 0.05)
    assert blocks_moved(last, 601, 10, 0.05)  # (at least one block)


def test_a_report_that_differs_only_in_its_number_and_time_says_the_same():
    assert says_the_same(report(1, 100.0), report(2, 100.05))
    assert not says_the_same(report(1), report(2, free=9))
    assert not says_the_same(report(1), report(2, accepted=1))


def test_a_report_goes_out_when_it_says_something_new_or_as_the_heartbeat():
    last = report(1)
    assert report_due(None, report(2), 0.0, 0.25)  # the first one
    assert not report_due(last, report(2), 0.05, 0.25)  # the same, within the heartbeat
    assert report_due(last, report(2, free=9), 0.05, 0.25)  # something new: at once
    assert report_due(last, report(2), 0.25, 0.25)  # the same, but the receivers need a sign of life
    assert report_due(last, report(2), 0.0, 0.0)  # heartbeat 0: every report, as before


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("value", ["-1", "0.9", "nan"])
def test_a_heartbeat_that_receivers_would_take_for_death_is_refused(value):
    with pytest.raises(SystemExit, match="--report-heartbeat-s"):
        config_from_args(parse("--report-heartbeat-s", value))


def test_a_report_interval_longer_than_the_heartbeat_is_taken():
    """Every report then goes out (they are a beat apart already)."""
    config = config_from_args(parse("--report-interval-s", "0.4"))
    assert (config.report_interval_s, config.report_heartbeat_s) == (0.4, 0.25)


async def test_an_idle_llumlet_beats_and_a_busy_one_reports_its_changes(nats_url):
    instance_id = f"beat-{uuid.uuid4().hex[:6]}"
    llumlet = Llumlet(LlumletConfig(instance_id, nats_url, report_interval_s=0.02, report_heartbeat_s=0.2),
                      SimEngine(sim_config(time_scale=0.02)))
    nc = await nats.connect(nats_url)
    arrivals: list[tuple[float, LoadReport]] = []

    async def on_report(msg):
        arrivals.append((time.monotonic(), decode(msg.data, LoadReport)))

    await nc.subscribe(subjects.load_report(instance_id), cb=on_report)
    await llumlet.start()
    try:
        await asyncio.sleep(1.0)  # idle: a heartbeat every 0.2 s, not a report every 0.02 s
        idle = [at for at, _ in arrivals]
        assert 3 <= len(idle) <= 8, idle
        gaps = [b - a for a, b in zip(idle[1:], idle[2:])]
        assert min(gaps) >= 0.15 and max(gaps) < 0.5, gaps
        assert llumlet.reports.num_skipped > 20

        arrivals.clear()
        llumlet.engine.add_request(gen("r", prompt=40, max_tokens=30))
        llumlet.wake_engine()
        async with asyncio.timeout(10):
            while llumlet.served.num_finished == 0:
                await asyncio.sleep(0.01)
        busy = [load for _, load in arrivals]
        assert any(load.num_running == 1 for load in busy)
        # While it decodes each report says something new: more of them than heartbeats would give.
        span = arrivals[-1][0] - arrivals[0][0]
        assert len(busy) > span / 0.2 + 2, (len(busy), span)
        assert all(not says_the_same(a, b) for a, b in zip(busy, busy[1:]) if b.sent_at - a.sent_at < 0.15)
    finally:
        await llumlet.stop()
        await nc.close()


async def test_a_scheduler_just_started_waits_for_an_idle_instances_beat_rather_than_refuse(nats_url):
    from services.global_scheduler.config import SchedulerConfig
    from services.global_scheduler.service import GlobalScheduler
    from shared.messages import DispatchReply, DispatchRequest, encode

    instance_id = f"quiet-{uuid.uuid4().hex[:6]}"
    llumlet = Llumlet(LlumletConfig(instance_id, nats_url, report_interval_s=0.02, report_heartbeat_s=0.5),
                      SimEngine(sim_config(time_scale=0.02)))
    await llumlet.start()
    await asyncio.sleep(0.1)  # its first report went before the scheduler was there; the next is a beat away
    scheduler = GlobalScheduler(SchedulerConfig(nats_url=nats_url))
    nc = await nats.connect(nats_url)
    try:
        await scheduler.start()
        assert len(scheduler.table) == 0
        reply = decode((await nc.request(subjects.DISPATCH, encode(DispatchRequest("r", 10, 4)), timeout=5)).data,
                       DispatchReply)
        assert reply.instance_id == instance_id, reply
    finally:
        await nc.close()
        await scheduler.stop()
        await llumlet.stop()


async def test_an_autoscaler_just_started_does_not_act_before_the_instances_have_beaten(nats_url, monkeypatch):
    """Its first tick waits out the heartbeat: on an empty table it would start instances the fleet has."""
    from services.autoscaler.config import AutoscalerConfig
    from services.autoscaler.service import Autoscaler
    from shared.engine_model.report_cadence import RECEIVER_WARM_UP_S
    from tests.unit.autoscaler_fakes import FakeProvider

    provider = FakeProvider()
    provider.started.append(("already-there", None))  # a pod that outlived an earlier autoscaler
    scaler = Autoscaler(AutoscalerConfig(nats_url=nats_url, tick_s=0.05), provider)
    ticks: list[float] = []

    async def tick() -> None:
        ticks.append(time.monotonic())

    monkeypatch.setattr(scaler, "tick", tick)
    started = time.monotonic()
    await scaler.start()
    try:
        await asyncio.sleep(RECEIVER_WARM_UP_S + 0.2)
        assert ticks and ticks[0] - started >= RECEIVER_WARM_UP_S - 0.01, (ticks[:1], started)
        assert provider.started == [("already-there", None)]  # it counted the one it found
    finally:
        await scaler.stop()
