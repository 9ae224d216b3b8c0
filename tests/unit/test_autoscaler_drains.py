"""The autoscaler's drains survive its restart: the llumlet reports who drained it, so a new
autoscaler finishes an earlier one's drain (stops the instance once empty) and leaves an
operator's drain alone (still no capacity: the scaling policy skips draining instances)."""

from __future__ import annotations

import argparse

import msgspec

from services.autoscaler.config import add_arguments, config_from_args
from services.autoscaler.service import Autoscaler
from shared.messages import DrainOrder, DrainSource, decode
from tests.unit.autoscaler_fakes import FakeBus, FakeProvider
from tests.unit.policy_helpers import make_load


def autoscaler(provider: FakeProvider, *argv: str) -> Autoscaler:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--nats-url", "nats://x:4222", "--sustain-s", "0",
                                                 "--cooldown-s", "0", *argv]))
    scaler = Autoscaler(config, provider)
    scaler.nc = FakeBus()
    return scaler


def report(instance_id: str, seq: int = 1, busy_blocks: int = 0, drained_by: DrainSource | None = None):
    load = make_load(instance_id, total=100, running={0: (1, busy_blocks)} if busy_blocks else None)
    return msgspec.structs.replace(load, seq=seq, draining=drained_by is not None, drained_by=drained_by)


def fleet_of(n: int) -> FakeProvider:
    provider = FakeProvider()
    for _ in range(n):
        provider.start_instance()
    return provider


async def test_its_drain_order_says_it_comes_from_the_autoscaler():
    provider = fleet_of(3)
    scaler = autoscaler(provider)
    await scaler._drain("auto-2")
    assert decode(scaler.nc.request_payloads[-1], DrainOrder) == DrainOrder(drain=True, by=DrainSource.AUTOSCALER)


async def test_a_restarted_autoscaler_stops_what_an_earlier_one_drained_once_empty():
    provider = fleet_of(3)
    scaler = autoscaler(provider)  # the new process: nothing in its draining set
    scaler.table.update(report("auto-0", busy_blocks=50))
    scaler.table.update(report("auto-1", busy_blocks=50))
    scaler.table.update(report("auto-2", busy_blocks=10, drained_by=DrainSource.AUTOSCALER))  # still emptying
    await scaler.tick()
    assert provider.stopped == []
    scaler.table.update(report("auto-2", seq=2, drained_by=DrainSource.AUTOSCALER))  # empty now
    await scaler.tick()
    assert provider.stopped == ["auto-2"]


async def test_an_operators_drain_is_not_stopped_and_is_no_capacity():
    provider = fleet_of(2)
    scaler = autoscaler(provider, "--max-instances", "4")
    # auto-0 is full; auto-1, empty, is being drained by a preStop: the fleet has no room left.
    scaler.table.update(report("auto-0", busy_blocks=99))
    scaler.table.update(report("auto-1", drained_by=DrainSource.OPERATOR))
    await scaler.tick()
    assert provider.stopped == []
    assert len(provider.started) == 3  # scaled out: the draining instance's free blocks did not count


async def test_an_instance_it_stopped_is_not_stopped_again_while_its_reports_linger():
    provider = fleet_of(3)  # (its `managed` leaves out what it stopped, as the providers' contract says)
    scaler = autoscaler(provider)
    for iid in ("auto-0", "auto-1"):
        scaler.table.update(report(iid, busy_blocks=50))
    scaler.table.update(report("auto-2", drained_by=DrainSource.AUTOSCALER))
    await scaler.tick()
    assert provider.stopped == ["auto-2"]
    scaler.table.update(report("auto-2", seq=2, drained_by=DrainSource.AUTOSCALER))  # a last report, late
    await scaler.tick()
    assert provider.stopped == ["auto-2"]
