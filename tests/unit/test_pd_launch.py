"""Instance roles on the command line (issue 19 §2): `corral llumlet --role`, `corral up
--prefill N --decode M`, and the gateway's bypass dispatch keeping to the dispatch pool."""

from __future__ import annotations

import argparse

import msgspec
import pytest
from nats.errors import NoRespondersError

from services.cli import build_parser, llumlet_roles
from services.gateway.dispatcher import Dispatcher
from services.gateway.instances import GatewayInstances
from services.gateway.metrics import GatewayMetrics
from services.llumlet.config import add_arguments, config_from_args
from services.supervisor import plan_children
from shared.messages import DispatchRequest, InstanceRole
from tests.unit.policy_helpers import make_load


def llumlet_config(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--nats-url", "nats://x:4222", *argv]))


def test_the_role_flag_and_its_environment_variable(monkeypatch):
    assert llumlet_config().role is InstanceRole.MIXED
    assert llumlet_config("--role", "prefill").role is InstanceRole.PREFILL
    monkeypatch.setenv("CORRAL_ROLE", "decode")
    assert llumlet_config().role is InstanceRole.DECODE
    monkeypatch.setenv("CORRAL_ROLE", "both")
    with pytest.raises(SystemExit, match="bad role 'both'"):
        llumlet_config()


def test_handoff_concurrency_must_be_positive():
    assert llumlet_config("--handoff-concurrency", "3").handoff_concurrency == 3
    with pytest.raises(SystemExit, match="--handoff-concurrency"):
        llumlet_config("--handoff-concurrency", "0")


def up_args(*argv: str) -> argparse.Namespace:
    args, _extra = build_parser().parse_known_args(["up", *argv])
    return args


def test_corral_up_prefill_and_decode_give_each_llumlet_its_role():
    assert llumlet_roles(up_args("--prefill", "1", "--decode", "2")) == ["prefill", "decode", "decode"]
    assert llumlet_roles(up_args("--instances", "3")) == []  # all mixed, as before
    for argv, why in ((("--prefill", "1"), "at least 1 each"),
                      (("--prefill", "1", "--decode", "1", "--instances", "4"), "drop --instances")):
        with pytest.raises(SystemExit, match=why):
            llumlet_roles(up_args(*argv))


def test_the_role_flag_comes_after_the_users_llumlet_flags():
    children = plan_children("nats://x:4222", 2, [], ["--role", "mixed", "--engine", "sim"], [], None, None,
                             "http://127.0.0.1:8000", 0, ["prefill", "decode"])
    llumlets = {c.name: c.argv for c in children if c.name.startswith("llumlet")}
    assert llumlets["llumlet-0"][-2:] == ["--role", "prefill"]
    assert llumlets["llumlet-1"][-2:] == ["--role", "decode"]


class NoScheduler:
    """A bus on which nobody answers dispatch: the gateway dispatches by itself (bypass mode)."""

    async def request(self, *args, **kwargs):
        raise NoRespondersError


async def test_bypass_dispatch_keeps_decode_instances_out_while_a_prefill_instance_lives():
    instances = GatewayInstances(timeout_s=60.0)
    # The decode instance is the freest: by freeness alone it would take every request.
    instances.update(msgspec.structs.replace(make_load("d", running={}), role=InstanceRole.DECODE))
    instances.update(msgspec.structs.replace(make_load("p", running={0: (2, 50)}), role=InstanceRole.PREFILL))
    dispatcher = Dispatcher(NoScheduler(), instances, GatewayMetrics("m", 4096), timeout_s=1.0)
    assert {await dispatcher.choose(DispatchRequest(f"r{i}", 10, 10)) for i in range(5)} == {"p"}
    assert dispatcher.bypassing
