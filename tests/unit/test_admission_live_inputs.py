"""What live admission control reads and reports beyond the policy (issue 19 §1): the llumlet's
tally of served requests and step pace, the scheduler's step inflation from it and its predicted
TTFT in the dispatch reply, and the gateway's comparison of that prediction with the TTFT it
measures."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import msgspec
import pytest

from services.gateway.dispatcher import Dispatcher, Placement
from services.gateway.generation import Generation
from services.gateway.instances import GatewayInstances
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import GenerationOptions
from services.gateway.streams import OutputStream
from services.global_scheduler.admission import AdmissionSettings
from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.service import GlobalScheduler
from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.service import Llumlet
from services.llumlet.served import STEP_WEIGHT, ServedTally
from shared.engine_model.latency import LatencyModel
from shared.engine_model.load_report import aggregate_views, build_load_report
from shared.engine_model.views import StepOutput
from shared.messages import DispatchReply, DispatchRequest, FinishReason, LoadReport, Refusal, TokenChunk, decode, encode
from shared.metrics_server import render
from shared.policy.admission import AdmissionPolicy, Slo, SloConfig, output_length_bin
from tests.unit.migration_helpers import gen, sim_config
from tests.unit.policy_helpers import make_load


# ---- the llumlet's tally ------------------------------------------------------------------------

def test_the_tally_counts_served_requests_with_their_whole_output():
    tally = ServedTally()
    tally.step_done(0.0, 0.02, [
        StepOutput("a", 9, [1], FinishReason.LENGTH, num_prompt_tokens=50),  # its 10th token
        StepOutput("b", 4, [1, 2], FinishReason.STOP, num_prompt_tokens=50),  # 6 tokens
        StepOutput("c", 3, [], FinishReason.ERROR),  # failed: says nothing of output lengths
        StepOutput("d", 7, [1], FinishReason.ABORT),
    ])
    assert (tally.num_finished, tally.finished_output_tokens) == (2, 16)
    assert tally.output_histogram[output_length_bin(10)] == tally.output_histogram[output_length_bin(6)] == 1
    assert sum(tally.output_histogram) == 2


def test_the_step_pace_averages_decoding_steps_only():
    tally = ServedTally()
    tally.step_done(0.0, 0.5, [StepOutput("p", 0, [1], num_prompt_tokens=900)])  # a prefill alone: no decode
    assert tally.decode_batch == 0.0 and tally.step_time_s == 0.0
    decoding = [StepOutput("a", 5, [1], num_prompt_tokens=100), StepOutput("b", 10, [1], num_prompt_tokens=200)]
    tally.step_done(1.0, 1.04, decoding)
    assert tally.step_time_s == pytest.approx(0.04) and tally.decode_batch == 2.0
    assert tally.decode_context == 105 + 210
    tally.step_done(2.0, 2.14, [*decoding, StepOutput("p2", 0, [1], num_prompt_tokens=900)])  # prefill mixed in
    assert tally.step_time_s == pytest.approx(0.04 + STEP_WEIGHT * 0.10)
    assert tally.decode_batch == 2.0


def test_an_idle_tally_forgets_its_pace_so_a_slow_burst_does_not_refuse_for_good():
    tally = ServedTally()
    decoding = [StepOutput("a", 5, [1], num_prompt_tokens=100), StepOutput("p", 0, [1], num_prompt_tokens=900)]
    tally.step_done(0.0, 0.3, decoding)  # a step slowed by a prefill mixed in
    assert tally.step_time_s == pytest.approx(0.3)
    tally.went_idle()
    assert (tally.step_time_s, tally.decode_batch, tally.decode_context) == (0.0, 0.0, 0.0)
    tally.step_done(1.0, 1.02, [StepOutput("b", 3, [1], num_prompt_tokens=50)])  # the next decoding step sets it
    assert tally.step_time_s == pytest.approx(0.02) and tally.decode_batch == 1.0


async def test_a_llumlet_that_ran_out_of_work_reports_no_pace(nats_url):
    llumlet = Llumlet(LlumletConfig(f"idle-{uuid.uuid4().hex[:6]}", nats_url, report_interval_s=0.05),
                      SimEngine(sim_config(time_scale=0.01)))
    await llumlet.start()
    try:
        llumlet.engine.add_request(gen("r", prompt=40, max_tokens=8))
        llumlet.wake_engine()
        async with asyncio.timeout(10):
            while llumlet.served.num_finished == 0:
                await asyncio.sleep(0.01)
            while llumlet.reports.current_load().step_time_s != 0.0:  # the loop has seen it idle
                await asyncio.sleep(0.01)
        assert not llumlet.engine.has_work()
    finally:
        await llumlet.stop()


def test_the_report_carries_the_tally():
    tally = ServedTally()
    tally.step_done(0.0, 0.03, [StepOutput("a", 3, [1], num_prompt_tokens=20),
                                StepOutput("b", 7, [1], FinishReason.STOP, num_prompt_tokens=20)])
    report = build_load_report(
        instance_id="i", seq=1, sent_at=1.0, requests=aggregate_views([]), num_blocks_total=10, num_blocks_free=10,
        block_size=16, num_preemptions_total=0, headroom_blocks=None, num_finished_total=tally.num_finished,
        finished_output_tokens_total=tally.finished_output_tokens,
        finished_output_histogram=tally.output_histogram, step_time_s=tally.step_time_s,
        step_decode_batch=tally.decode_batch, step_decode_context=tally.decode_context)
    again = decode(encode(report), LoadReport)
    assert (again.num_finished_total, again.finished_output_tokens_total) == (1, 8)
    assert again.finished_output_histogram[output_length_bin(8)] == 1 and sum(again.finished_output_histogram) == 1
    assert (again.step_time_s, again.step_decode_batch, again.step_decode_context) == (0.03, 2.0, 50.0)


# ---- the scheduler -------------------------------------------------------------------------------

SLO = SloConfig(Slo(ttft_s=1.0, tbt_s=0.1), reserve=0.1)
A10 = LatencyModel("A10")


def scheduler(load: LoadReport, policy: AdmissionPolicy = AdmissionPolicy.PREDICTED) -> GlobalScheduler:
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222", admission=AdmissionSettings(policy, SLO)))
    load.sent_at = time.time()
    s.take_report(load)
    return s


def paced(load: LoadReport, inflation: float) -> LoadReport:
    """The load with a step pace `inflation` times the A10's decode-only step for 20 requests of 600 tokens."""
    load.step_decode_batch, load.step_decode_context = 20.0, 20 * 600.0
    load.step_time_s = inflation * A10.decode_ms(20, 20 * 600) / 1e3
    return load


def test_an_admitted_request_carries_its_predicted_ttft():
    load = make_load("a", total=2000, block_size=16, running={0: (2, 40)}, waiting=[20])  # 320 tokens ahead
    reply = scheduler(load).decide(DispatchRequest("r0", 100, 16))
    assert reply.instance_id == "a"
    queued = load.waiting_demand_blocks * 16  # and half the step in flight: a chunk that size, 2 decoding
    in_flight = 0.5 * (A10.prefill_ms(queued) + A10.decode_ms(2, 2 * 40 * 16 // 2)) / 1e3
    expected = (A10.prefill_ms(queued) + A10.prefill_ms(100)) / 1e3 + in_flight
    assert reply.predicted_ttft_s == pytest.approx(expected, rel=0.05)
    without = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    without.table.update(make_load("a"))
    without.table.get("a").sent_at = time.time()
    assert without.decide(DispatchRequest("r1", 100, 16)).predicted_ttft_s is None


def test_a_slow_step_pace_refuses_on_tbt_what_the_model_alone_admits():
    """20 requests decoding: the model's step is well inside 100 ms, a pace four times slower
    (prefill mixed into every step) is not."""
    def load():
        return make_load("a", total=6000, running={0: (20, 800)})
    assert scheduler(load()).decide(DispatchRequest("r0", 100, 16)).instance_id == "a"
    assert scheduler(paced(load(), 1.0)).decide(DispatchRequest("r0", 100, 16)).instance_id == "a"
    slow = scheduler(paced(load(), 4.0))
    reply = slow.decide(DispatchRequest("r0", 100, 16))
    assert reply.reason is Refusal.OVERLOADED and "tbt" in reply.rejected


# ---- the gateway ---------------------------------------------------------------------------------

class FakeNats:
    def __init__(self, reply: DispatchReply) -> None:
        self.reply = reply

    async def request(self, subject, data, timeout, headers=None):
        return SimpleNamespace(data=encode(self.reply))


async def test_the_dispatcher_passes_the_prediction_on():
    def dispatcher(reply):
        return Dispatcher(FakeNats(reply), GatewayInstances(5.0), GatewayMetrics("m", 2048), timeout_s=0.5)  # type: ignore[arg-type]
    request = DispatchRequest("r", 10, 4)
    assert await dispatcher(DispatchReply(instance_id="a", predicted_ttft_s=0.25)).place(request) == Placement("a", 0.25)
    assert await dispatcher(DispatchReply(instance_id="a")).choose(request) == "a"


async def first_token_after(predicted_s: float | None, elapsed_s: float, metrics: GatewayMetrics) -> None:
    stream = OutputStream("r1", "a")
    stream.predicted_ttft_s = predicted_s
    generation = Generation(stream, lambda ids: "x" * len(ids), [1, 2], GenerationOptions(), 5.0,
                            arrival=time.monotonic() - elapsed_s, token_times=metrics)
    stream.feed(TokenChunk("r1", "a", 0, [5], finish_reason=FinishReason.LENGTH))
    await anext(generation.events())


def sample(metrics: GatewayMetrics, suffix: str, direction: str) -> float:
    value = metrics.registry.get_sample_value(f"corral:gateway_ttft_prediction_error_seconds_{suffix}",
                                              {"model_name": "tiny", "direction": direction})
    return value or 0.0


async def test_the_gateway_exports_how_far_the_ttft_strayed_from_the_prediction():
    metrics = GatewayMetrics("tiny", 2048)
    assert 'corral:gateway_ttft_prediction_error_seconds_count{direction="late",model_name="tiny"} 0.0' in \
        render(metrics.registry).decode()
    await first_token_after(0.2, 0.5, metrics)  # ~0.3 s late
    await first_token_after(2.0, 0.5, metrics)  # ~1.5 s early
    await first_token_after(None, 0.5, metrics)  # no admission: no prediction to compare
    assert sample(metrics, "count", "late") == 1 and sample(metrics, "count", "early") == 1
    assert 0.3 <= sample(metrics, "sum", "late") < 0.4
    assert 1.4 < sample(metrics, "sum", "early") <= 1.5


# ---- dispatches a report does not show yet -----------------------------------------------------------

def report(seq: int, accepted: int, waiting: list[int] | None = None) -> LoadReport:
    load = make_load("a", total=128, waiting=waiting)
    return msgspec.structs.replace(load, seq=seq, sent_at=time.time(), num_accepted_total=accepted)


def test_a_report_that_overtook_two_dispatches_does_not_wipe_them():
    """Prompts of 500 tokens (32 blocks): three fit 128 blocks with the normal priority's reserve.
    Two dispatched, then a report built before either arrived: without counting them back, admission
    would take three more (measured live: a burst put five on one such instance)."""
    s = scheduler(report(1, accepted=0))
    assert [s.decide(DispatchRequest(f"r{i}", 500, 16)).instance_id for i in range(2)] == ["a", "a"]
    s.take_report(report(2, accepted=0))  # built before the two arrived
    assert s.decide(DispatchRequest("r2", 500, 16)).instance_id == "a"
    assert s.decide(DispatchRequest("r3", 500, 16)).reason is Refusal.OVERLOADED
    # Once its reports show them (accepted, queued), they count once, not twice.
    s.take_report(report(3, accepted=3, waiting=[32, 32, 32]))
    assert s.decide(DispatchRequest("r4", 500, 16)).reason is Refusal.OVERLOADED
    s.take_report(report(4, accepted=3, waiting=[32, 32]))  # one finished: room for one
    assert s.decide(DispatchRequest("r5", 500, 16)).instance_id == "a"


def test_with_no_instance_live_the_refusal_is_no_instance_not_overload():
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222",
                                        admission=AdmissionSettings(AdmissionPolicy.PREDICTED, SLO)))
    assert s.decide(DispatchRequest("r0", 100, 16)).reason is Refusal.NO_INSTANCE
