"""Where `predicted` admission decides differently from `current-load` (issue 19 §1), on
hand-built loads: the decode pool at a request's hand-off with P/D roles
(shared/policy/decode_pool.py), and the prefill a prompt adds to the steps of the requests
already decoding (shared/policy/prefill_interference.py)."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.global_scheduler.admission import AdmissionSettings
from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.service import GlobalScheduler
from shared.messages import DispatchRequest, InstanceRole, Refusal
from shared.policy.admission import (
    AdmissionPolicy,
    InstanceOutlook,
    OutputLengthEstimate,
    RejectReason,
    Slo,
    SloConfig,
    admit,
)
from shared.policy.decode_pool import HANDOFF_WINDOW_TOKENS, DecodePool, decode_loads, forecast, in_flight_of
from shared.policy.prefill_interference import expected_pushed_past_tbt
from tests.unit.policy_helpers import make_load

from tests.unit.test_admission import LATENCY  # 1 ms per prefill token; a step of 10 ms + 1 ms per request
SLO = SloConfig(Slo(ttft_s=5.0, tbt_s=0.050), reserve=0.0)
CURRENT, PREDICTED = AdmissionPolicy.CURRENT_LOAD, AdmissionPolicy.PREDICTED


def served(length: int, times: int = 1000) -> OutputLengthEstimate:
    est = OutputLengthEstimate(prior_mean=100.0, prior_weight=1.0)
    for _ in range(times):
        est.observe(length)
    return est


def instance(iid="p", *, queued=0, generated=(), output=None, inflation=1.0, used=0, total=1000, hands_off=False):
    return InstanceOutlook(iid, queued, 0, tuple(generated), 200.0, output or served(20),
                           free_blocks_after_queue=total - used, step_inflation=inflation, total_blocks=total,
                           hands_off=hands_off)


# ---- P/D: the decode pool when the prefill completes ----------------------------------------------

def test_requests_on_their_way_fill_the_decode_pool_that_looks_empty_now():
    # The decode instance holds 10 of its 100 blocks. 5 prefilled-or-queued requests on the
    # prefill instances bring 85 more, this prompt 11: at its hand-off there is no room, and it
    # would decode on its prefill instance, whose steps carry prefill (6x its decode-only time:
    # 66 ms, past 50). Current load sees 21 blocks and a small batch, and admits.
    pool = DecodePool([instance("d", generated=[5], used=10, total=100, output=served(500))], 5, 85)
    prefill = instance("p", queued=300, inflation=6.0, hands_off=True)
    current = admit([prefill], 160, 0, CURRENT, SLO, LATENCY, pool)
    predicted = admit([prefill], 160, 0, PREDICTED, SLO, LATENCY, pool)
    assert current.accepted
    assert predicted.rejected is RejectReason.TBT
    assert forecast(pool, 0.46, 160, True, LATENCY).blocks > 100 >= forecast(pool, 0.46, 160, False, LATENCY).blocks


def test_requests_ending_before_the_hand_off_make_room_current_load_does_not_see():
    # The decode instance is full now (95 of 100 blocks, 20 requests 18 tokens in, every served
    # output 20 tokens long). The prompt waits 0.9 s behind the prefill queue: by then (~30 steps)
    # they have all ended. Current load finds no room and falls back to the prefill instance,
    # too slow; predicted finds the pool all but empty.
    pool = DecodePool([instance("d", generated=[18] * 20, used=95, total=100)])
    prefill = instance("p", queued=800, inflation=6.0, hands_off=True)
    assert admit([prefill], 100, 0, CURRENT, SLO, LATENCY, pool).rejected is RejectReason.TBT
    decision = admit([prefill], 100, 0, PREDICTED, SLO, LATENCY, pool)
    assert decision.accepted and decision.predictions[0].decode_batch <= 2  # (the prior's sliver rounds up)


def test_departures_are_counted_until_the_last_request_on_its_way_lands():
    # 20 requests 18 tokens into 20-token outputs; 10 on their way, the last prefilled in 1 s.
    # A request handed off at once still meets all 20; it decodes while the 10 land, and by
    # then the 20 have ended: over that span the pool holds the 10 and itself.
    running = [instance("d", generated=[18] * 20)]
    at_once = forecast(DecodePool(running, 10, 100), 0.01, 100, True, LATENCY)
    over_the_span = forecast(DecodePool(running, 10, 100, last_landing_s=1.0), 0.01, 100, True, LATENCY)
    assert at_once.batch >= 29  # (a sliver of them ends within the 0.01 s)
    assert over_the_span.batch <= 12


def test_the_pool_batch_is_shared_evenly_and_priced_at_the_pools_pace():
    pool = DecodePool([instance("d1", generated=[1000] * 30, output=served(5000)),
                       instance("d2", generated=[1000] * 10, output=served(5000))], in_flight=9)
    ahead = forecast(pool, 0.1, 100, True, LATENCY)
    assert ahead.batch == 25  # (40 still running + 9 on their way + itself) over 2
    assert ahead.tbt_s == pytest.approx(LATENCY.decode_s(25, 0))
    assert forecast(pool, 0.1, 100, False, LATENCY).batch == 21  # now: 40 and itself


def test_in_flight_counts_waiting_and_fresh_requests_not_those_decoding_for_good():
    load = make_load("p", total=1000, running={0: (4, 200)}, waiting=[30, 40])
    load = msgspec.structs.replace(load, role=InstanceRole.PREFILL,
                                   running_output_tokens=[0, 1, HANDOFF_WINDOW_TOKENS + 1, 300])
    assert in_flight_of([load]) == (2 + 2, 70 + 100)  # 2 waiting (70 blocks), 2 running of 4 (half of 200)


def test_a_fleet_without_a_live_prefill_instance_has_no_decode_pool():
    decode = msgspec.structs.replace(make_load("d"), role=InstanceRole.DECODE)
    prefill = msgspec.structs.replace(make_load("p"), role=InstanceRole.PREFILL)
    assert decode_loads([decode, make_load("m")]) == []
    assert decode_loads([decode, msgspec.structs.replace(prefill, draining=True)]) == []
    assert decode_loads([decode, prefill]) == [decode]


def _scheduler(policy: AdmissionPolicy, *loads) -> GlobalScheduler:
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222", admission=AdmissionSettings(
        policy, SloConfig(Slo(ttft_s=2.0, tbt_s=0.1), reserve=0.0, handoff_reserve=0.0))))
    for load in loads:
        s.table.update(msgspec.structs.replace(load, sent_at=time.time()))
        s.roles.saw(s.table.get(load.instance_id))
    return s


def test_the_scheduler_forecasts_the_decode_pool_from_the_reports():
    """Live: the decode instance's report shows room now (20 of 400 blocks); the prefill
    instance's report shows 12 requests on their way with 380 blocks of prompts, so at the
    hand-off the pool is full and the prefill instance's steps (paced at 8x the A10's
    decode-only time) would carry it. Current load admits; predicted refuses on TBT."""
    decode = msgspec.structs.replace(make_load("d", total=400, running={0: (2, 20)}), role=InstanceRole.DECODE,
                                     running_output_tokens=[3, 3])
    prefill = msgspec.structs.replace(make_load("p", total=2000, waiting=[380 // 12] * 11 + [380 - 11 * (380 // 12)]),
                                      role=InstanceRole.PREFILL, step_time_s=8 * 0.0307, step_decode_batch=1.0,
                                      step_decode_context=600.0)
    request = DispatchRequest("r0", 100, 16)
    assert _scheduler(CURRENT, decode, prefill).decide(request).instance_id == "p"
    reply = _scheduler(PREDICTED, decode, prefill).decide(request)
    assert reply.reason is Refusal.OVERLOADED and "tbt" in reply.rejected


# ---- colocated: the prefill it adds to the running requests' steps --------------------------------

def test_a_long_prompt_that_would_push_short_running_requests_past_the_tbt_target_is_refused():
    # 10 requests 2 tokens into 10-token outputs, 20 ms steps: a 2,000-token prefill (2 s) in
    # their ~8 remaining steps puts every one past 50 ms. The batch itself is small: current
    # load admits. A 30-token prompt adds 30 ms to their ~9 steps: admitted by both.
    running = instance(generated=[2] * 10, output=served(10))
    assert admit([running], 2000, 0, CURRENT, SLO, LATENCY).accepted
    refused = admit([running], 2000, 0, PREDICTED, SLO, LATENCY)
    assert refused.rejected is RejectReason.TBT and refused.predictions[0].pushed == pytest.approx(10, abs=0.1)
    assert admit([running], 30, 0, PREDICTED, SLO, LATENCY).accepted


def test_long_running_requests_absorb_a_prefill():
    # The same prompt over requests with ~1,000 tokens to go adds 2 ms to each step: no one pushed.
    running = instance(generated=[2] * 10, output=served(1000))
    assert expected_pushed_past_tbt(running, 2000, LATENCY, 0.05) == pytest.approx(0.0, abs=0.05)
    assert admit([running], 2000, 0, PREDICTED, SLO, LATENCY).accepted


def test_requests_past_the_target_already_and_those_done_before_the_queue_are_not_counted():
    # At 6x the pace they are past 50 ms whatever is admitted: admitting costs nothing more.
    lost = instance(generated=[8] * 10, output=served(10), inflation=6.0)
    assert expected_pushed_past_tbt(lost, 2000, LATENCY, 0.05) == pytest.approx(0.0, abs=0.05)
    # 4,096 tokens queued ahead take two steps a 2,048-token budget: requests with 2 steps left
    # are gone before the new prompt's prefill starts.
    ending = instance(queued=4096, generated=[8] * 10, output=served(10))
    assert expected_pushed_past_tbt(ending, 2000, LATENCY, 0.05) == pytest.approx(0.0, abs=0.05)
