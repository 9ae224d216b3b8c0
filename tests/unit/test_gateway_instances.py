"""The gateway's instance table (liveness from load reports) and its dispatcher (scheduler or bypass)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import msgspec
import pytest
from nats.errors import NoRespondersError

from services.gateway.dispatcher import Dispatcher
from services.gateway.errors import refusal_error
from services.gateway.instances import GatewayInstances
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import ApiError
from shared.messages import DispatchReply, DispatchRequest, LoadReport, Refusal, encode

TIMEOUT_S = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(instance_id: str, seq: int = 1, free_blocks: int = 1000, max_model_len: int = 0) -> LoadReport:
    return LoadReport(instance_id, seq, 0.0, num_blocks_total=1000, num_blocks_free=free_blocks, block_size=16,
                      num_running=0, num_waiting=0, head_demand_blocks=0, waiting_demand_blocks=0,
                      num_preemptions_total=0, max_model_len=max_model_len)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def instances(clock) -> GatewayInstances:
    return GatewayInstances(TIMEOUT_S, clock)


def test_instance_is_alive_until_its_reports_stop_for_the_timeout(instances, clock):
    instances.update(report("a"))
    clock.now += TIMEOUT_S - 0.1
    assert instances.alive_count() == 1 and not instances.is_silent("a", since=0.0)
    clock.now += 0.2
    assert instances.alive_count() == 0 and instances.is_silent("a", since=0.0)


def test_a_report_built_before_our_own_dispatches_arrived_does_not_wipe_them(instances, clock):
    """Bypass dispatch (no scheduler) accounts each request on the instance; a report that overtook
    the generate orders keeps them until its accepted orders count them off."""
    instances.update(report("a"))
    for i in range(3):
        instances.account("a", DispatchRequest(f"r{i}", 100, 4))
    instances.update(report("a", seq=2))  # built before any arrived (none accepted)
    assert instances.live_loads()[0].num_waiting == 3
    arrived = msgspec.structs.replace(report("a", seq=3), num_accepted_total=2, num_waiting=2,
                                      waiting_demand_blocks=14)
    instances.update(arrived)  # two arrived and are in its queue: not counted twice
    assert instances.live_loads()[0].num_waiting == 3


def test_unknown_instance_gets_the_timeout_from_when_we_started_relying_on_it(instances, clock):
    since = clock.now
    clock.now += TIMEOUT_S - 0.1
    assert not instances.is_silent("new", since)
    clock.now += 0.2
    assert instances.is_silent("new", since)


def test_marked_dead_instance_is_silent_at_once_until_it_reports_again(instances, clock):
    instances.update(report("a", seq=5))
    instances.mark_dead("a")
    assert instances.is_silent("a", since=clock.now) and instances.live_loads() == []
    instances.update(report("a", seq=6))
    assert not instances.is_silent("a", since=clock.now)


def test_an_instance_whose_reports_came_late_lately_is_given_longer_up_to_the_timeout(instances, clock):
    for seq in range(1, 5):  # reports 0.9 s apart: starved, not dead
        instances.update(report("slow", seq))
        instances.update(report("punctual", seq))
        clock.now += 0.9
    assert instances.death_limit_s("punctual", 0.8) == pytest.approx(1.8)  # (its reports came 0.9 s apart too)
    for seq in range(5, 5 + 20 * 60):  # a minute of punctual 50 ms reports from one of them
        instances.update(report("punctual", seq))
        clock.now += 0.05
    assert instances.death_limit_s("punctual", 0.8) == 0.8
    assert instances.death_limit_s("slow", 0.8) == pytest.approx(1.8)  # as of its last report
    for seq in range(10):  # very slow: capped at the generic timeout
        instances.update(report("slow", 100 + seq))
        clock.now += 2.5
    assert instances.death_limit_s("slow", 0.8) == TIMEOUT_S


def test_max_model_len_comes_from_the_report(instances):
    instances.update(report("a", max_model_len=2048))
    instances.update(report("b"))
    assert (instances.max_model_len("a"), instances.max_model_len("b"), instances.max_model_len("c")) == (2048, None, None)


class FakeNats:
    """Answers `request` with a dispatch reply, or raises what a missing/slow scheduler raises."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome

    async def request(self, subject, data, timeout, headers=None):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return SimpleNamespace(data=encode(self.outcome))


def dispatcher(instances: GatewayInstances, outcome) -> Dispatcher:
    return Dispatcher(FakeNats(outcome), instances, GatewayMetrics("m", 2048), timeout_s=0.5)  # type: ignore[arg-type]


def request(i: int, priority: int = 0, exclude: list[str] | None = None) -> DispatchRequest:
    return DispatchRequest(f"req-{i}", num_prompt_tokens=160, max_tokens=16, priority=priority, exclude=exclude or [])


async def test_scheduler_answer_is_used_as_is(instances):
    assert await dispatcher(instances, DispatchReply(instance_id="far-away")).choose(request(0)) == "far-away"


@pytest.mark.parametrize("failure", [NoRespondersError(), TimeoutError()], ids=["no scheduler", "slow scheduler"])
async def test_bypass_spreads_a_burst_over_equal_instances(instances, failure):
    for name in ("a", "b", "c"):
        instances.update(report(name))
    chosen = Counter([await dispatcher(instances, failure).choose(request(i)) for i in range(30)])
    assert set(chosen) == {"a", "b", "c"} and max(chosen.values()) - min(chosen.values()) <= 1


async def test_bypass_prefers_the_freer_instance(instances):
    instances.update(msgspec.structs.replace(report("busy"), num_waiting=5, waiting_demand_blocks=900))
    instances.update(report("idle"))
    assert await dispatcher(instances, NoRespondersError()).choose(request(1)) == "idle"


async def test_bypass_respects_exclusions(instances):
    instances.update(report("a"))
    instances.update(report("b"))
    d = dispatcher(instances, NoRespondersError())
    assert {await d.choose(request(i, exclude=["a"])) for i in range(10)} == {"b"}


async def test_bypass_without_live_instances_is_a_503(instances):
    with pytest.raises(ApiError) as info:
        await dispatcher(instances, NoRespondersError()).choose(request(0))
    assert info.value.status == 503


async def test_bypass_episode_ends_when_the_scheduler_answers(instances):
    instances.update(report("a"))
    d = dispatcher(instances, NoRespondersError())
    await d.choose(request(0))
    assert d.bypassing
    d._nc = FakeNats(DispatchReply(instance_id="a"))
    await d.choose(request(1))
    assert not d.bypassing


@pytest.mark.parametrize("reason, retry_after, status", [
    (Refusal.TOO_LONG, None, 400),
    (Refusal.INVALID, None, 400),
    (Refusal.DUPLICATE, None, 409),
    (Refusal.NO_INSTANCE, None, 503),
    (Refusal.DRAINING, None, 503),
    (Refusal.OVERLOADED, 0.2, 429),
])
def test_refusals_map_to_http_statuses(reason, retry_after, status):
    error = refusal_error(reason, "no", "messages", retry_after)
    assert (error.status, error.reason) == (status, reason)
    assert error.param == ("messages" if reason is Refusal.TOO_LONG else None)
    assert error.headers == ({"retry-after": "1", "retry-after-ms": "200"} if retry_after else {})


@pytest.mark.parametrize("reply, status, param", [
    (DispatchReply(rejected="prompt is longer than any instance's max_model_len", reason=Refusal.TOO_LONG), 400,
     "messages"),
    (DispatchReply(rejected="all instances are overloaded", reason=Refusal.OVERLOADED, retry_after_s=2.0), 429, None),
    (DispatchReply(rejected="something new", reason=None), 429, None),  # a scheduler too old to say why
], ids=["too long", "overloaded", "no reason"])
async def test_scheduler_refusal_follows_its_reason_not_its_words(instances, reply, status, param):
    with pytest.raises(ApiError) as info:
        await dispatcher(instances, reply).choose(request(0), prompt_param="messages")
    assert (info.value.status, info.value.param) == (status, param)


async def test_bypass_refuses_a_prompt_no_instance_holds_naming_the_prompt_field(instances):
    instances.update(msgspec.structs.replace(report("a"), max_model_len=100))
    with pytest.raises(ApiError) as info:
        await dispatcher(instances, NoRespondersError()).choose(request(0), prompt_param="prompt")
    assert (info.value.status, info.value.reason, info.value.param) == (400, Refusal.TOO_LONG, "prompt")
