"""Prefill/decode pools scaled on their own signals (issue 19 §2): the pure decision per pool, the
autoscaler acting on each pool apart (fake provider and bus), and its flags."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from services.autoscaler.config import add_arguments, config_from_args
from services.autoscaler.service import Autoscaler
from shared.messages import InstanceRole
from shared.policy.config import ScalingConfig
from shared.policy.scaling import PrefillBand, ScaleAction, ScalingState, pool_scaling_decision, queued_prefill_tokens
from tests.unit.autoscaler_fakes import FakeBus, FakeProvider
from tests.unit.policy_helpers import make_load

SCALING = ScalingConfig(scale_out_below=2.0, scale_in_above=40.0, sustain_s=5.0, cooldown_s=0.0, min_instances=1,
                        max_instances=4)
BAND = PrefillBand(scale_out_tokens=1000, scale_in_tokens=0)


def as_role(load, role: InstanceRole):
    return msgspec.structs.replace(load, role=role)


def prefill(iid: str, queued_blocks: list[int] | None = None):
    return as_role(make_load(iid, total=100, waiting=queued_blocks), InstanceRole.PREFILL)


def decode(iid: str, running_blocks: int):
    return as_role(make_load(iid, total=100, running={0: (4, running_blocks)}), InstanceRole.DECODE)


def sustained(role, loads):
    _, state = pool_scaling_decision(role, loads, ScalingState(), SCALING, BAND, now=0.0)
    return pool_scaling_decision(role, loads, state, SCALING, BAND, now=5.0)[0]


def test_queued_prefill_tokens_average_the_live_instances():
    loads = [prefill("a", [10, 20]), prefill("b"), msgspec.structs.replace(prefill("c", [99]), draining=True)]
    assert queued_prefill_tokens(loads) == 30 * 16 / 2


def test_a_prefill_queue_scales_the_prefill_pool_out_and_not_the_decode_pool():
    # 80 queued blocks × 16 tokens on the one prefill instance; the decode instance is comfortable.
    loads = [prefill("p", [40, 40]), decode("d", 40)]
    assert sustained(InstanceRole.PREFILL, loads).action is ScaleAction.OUT
    assert sustained(InstanceRole.DECODE, loads).action is ScaleAction.NONE


def test_a_full_decode_pool_scales_out_while_prefill_idles_in():
    loads = [prefill("p0"), prefill("p1"), decode("d", 99)]  # decode freeness (100-99)/4 < 2
    assert sustained(InstanceRole.DECODE, loads).action is ScaleAction.OUT
    decision = sustained(InstanceRole.PREFILL, loads)  # no queue, empty memory: one prefill instance goes
    assert decision.action is ScaleAction.IN and decision.victim in {"p0", "p1"}


def test_a_short_prefill_queue_is_inside_the_band():
    loads = [prefill("p", [10]), decode("d", 40)]  # 160 tokens queued: neither out nor in
    assert sustained(InstanceRole.PREFILL, loads).action is ScaleAction.NONE


def test_an_empty_pool_starts_an_instance():
    decision, _ = pool_scaling_decision(InstanceRole.PREFILL, [decode("d", 40)], ScalingState(), SCALING, BAND, 0.0)
    assert decision.action is ScaleAction.OUT


def autoscaler_args(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--nats-url", "nats://x:4222", *argv]))


async def test_each_pool_is_scaled_apart_with_its_role():
    config = autoscaler_args("--initial-prefill", "1", "--initial-decode", "1", "--sustain-s", "0",
                             "--cooldown-s", "10", "--prefill-scale-out-tokens", "1000")
    provider = FakeProvider()
    scaler = Autoscaler(config, provider)
    scaler.nc = FakeBus()
    for _ in range(config.initial_prefill):
        await scaler._start_one(InstanceRole.PREFILL)
    await scaler._start_one(InstanceRole.DECODE)
    assert provider.started == [("auto-0", InstanceRole.PREFILL), ("auto-1", InstanceRole.DECODE)]
    # Both report: the prefill one with a long queue, the decode one comfortable.
    scaler.table.update(msgspec.structs.replace(prefill("auto-0", [40, 40]), seq=1))
    scaler.table.update(msgspec.structs.replace(decode("auto-1", 40), seq=1))
    scaler._starting.clear()
    await scaler.tick()
    assert provider.started[2:] == [("auto-2", InstanceRole.PREFILL)]
    # The prefill pool cools down; the decode pool, comfortable, neither grows nor shrinks.
    await scaler.tick()
    assert len(provider.started) == 3 and scaler.nc.requests == []


def test_pool_flags():
    config = autoscaler_args("--initial-prefill", "2", "--initial-decode", "9", "--max-instances", "4")
    assert (config.disaggregated, config.initial_prefill, config.initial_decode) == (True, 2, 4)
    assert not autoscaler_args().disaggregated
    with pytest.raises(SystemExit, match="at least 1 each"):
        autoscaler_args("--initial-prefill", "1")
    with pytest.raises(SystemExit, match="prefill band"):
        autoscaler_args("--initial-prefill", "1", "--initial-decode", "1", "--prefill-scale-out-tokens", "0")
