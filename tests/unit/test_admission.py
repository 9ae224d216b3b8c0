"""Admission control (shared/policy/admission.py) on hand-built instance loads."""

from __future__ import annotations

import pytest

from shared.policy.admission import (
    AdmissionPolicy,
    InstanceOutlook,
    LatencyFns,
    OutputLengthEstimate,
    RejectReason,
    Slo,
    SloConfig,
    admit,
    predict,
)
from shared.policy.config import HIGH_PRIORITY

# 1 ms per prefill token; a decode step of 10 ms + 1 ms per request in the batch.
LATENCY = LatencyFns(prefill_s=lambda n: n * 1e-3 if n > 0 else 0.0, decode_s=lambda bs, ctx: 0.010 + 0.001 * bs)
SLO = SloConfig(Slo(ttft_s=1.0, tbt_s=0.050), reserve=0.0)


def outlook(iid="a", queued=0, num_queued=0, generated=(), mean=100.0):
    return InstanceOutlook(iid, queued, num_queued, tuple(generated), 200.0,
                           OutputLengthEstimate(prior_mean=mean, prior_weight=1.0))


def test_ttft_is_queued_prefill_plus_own_prompt():
    p = predict(outlook(queued=300), 200, AdmissionPolicy.PREDICTED, LATENCY)
    assert p.ttft_s == pytest.approx(0.5)


def test_none_admits_everything():
    d = admit([outlook(queued=10**6)], 10**5, 0, AdmissionPolicy.NONE, SLO, LATENCY)
    assert d.accepted and d.admitted == ("a",)


def test_rejects_on_ttft_when_every_queue_is_too_long():
    loads = [outlook("a", queued=900), outlook("b", queued=950)]
    d = admit(loads, 200, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY)
    assert not d.accepted and d.rejected is RejectReason.TTFT
    ok = admit(loads + [outlook("c", queued=100)], 200, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY)
    assert ok.admitted == ("c",)


def test_predicted_counts_requests_that_finish_during_the_prefill_out_of_the_batch():
    # 40 running requests: the current batch of 41 steps in 51 ms, past the 50 ms target. The
    # 0.9 s prefill spans 18 such steps; the 30 requests past the 40-token mean have 10 left (the
    # tail floor) and finish by then, the 10 fresh ones (40 left) stay.
    generated = [99] * 30 + [0] * 10
    load = outlook(queued=700, generated=generated, mean=40.0)  # floor 10 tokens; 0.9 s / 0.05 s = 18 steps
    current = admit([load], 200, 0, AdmissionPolicy.CURRENT_LOAD, SLO, LATENCY)
    predicted = admit([load], 200, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY)
    assert current.rejected is RejectReason.TBT
    assert current.predictions[0].decode_batch == 41
    assert predicted.accepted
    assert predicted.predictions[0].decode_batch == 11  # the 10 fresh ones (40 tokens left) and itself


def test_predicted_keeps_long_running_requests_by_the_tail_floor():
    # Past the mean, a request still has tail_fraction of it left: with a short TTFT they stay.
    load = outlook(queued=0, generated=[500] * 45, mean=100.0)  # 25 tokens left each
    p = predict(load, 10, AdmissionPolicy.PREDICTED, LATENCY)  # 10 ms of prefill: < 1 step
    assert p.decode_batch == 46
    assert admit([load], 10, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY).rejected is RejectReason.TBT


def test_queued_requests_join_the_batch_in_both_policies():
    load = outlook(queued=100, num_queued=45)
    for policy in (AdmissionPolicy.CURRENT_LOAD, AdmissionPolicy.PREDICTED):
        assert predict(load, 10, policy, LATENCY).decode_batch == 46


def test_high_priority_is_rejected_last():
    slo = SloConfig(Slo(ttft_s=1.0, tbt_s=0.050), reserve=0.2)  # normal must predict <= 0.8 s
    load = outlook(queued=700)  # 0.9 s with a 200-token prompt
    assert admit([load], 200, 0, AdmissionPolicy.PREDICTED, slo, LATENCY).rejected is RejectReason.TTFT
    assert admit([load], 200, HIGH_PRIORITY, AdmissionPolicy.PREDICTED, slo, LATENCY).accepted


def test_per_priority_slo_override():
    slo = SloConfig(Slo(1.0, 0.05), by_priority={HIGH_PRIORITY: Slo(0.2, 0.05)}, reserve=0.0)
    load = outlook(queued=300)
    assert admit([load], 200, 0, AdmissionPolicy.PREDICTED, slo, LATENCY).accepted
    assert admit([load], 200, HIGH_PRIORITY, AdmissionPolicy.PREDICTED, slo, LATENCY).rejected is RejectReason.TTFT


def test_no_candidate_is_a_rejection():
    assert admit([], 10, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY).rejected is RejectReason.NO_INSTANCE


def test_output_estimate_moves_from_the_prior_to_what_was_served():
    est = OutputLengthEstimate(prior_mean=256.0, prior_weight=8.0)
    assert est.mean == 256.0
    for _ in range(992):
        est.observe(10)
    assert est.mean == pytest.approx((256 * 8 + 9920) / 1000)
    assert est.remaining(0) == pytest.approx(est.mean)
    assert est.remaining(10_000) == pytest.approx(0.25 * est.mean)


def test_slo_rejects_bad_targets():
    with pytest.raises(ValueError):
        Slo(0.0, 0.05)
    with pytest.raises(ValueError):
        SloConfig(Slo(1.0, 0.05), reserve=1.0)


def test_no_room_for_the_prompt_after_the_queue_is_a_ttft_rejection():
    full = InstanceOutlook("a", 0, 0, (), 0.0, OutputLengthEstimate(), free_blocks_after_queue=5, block_size=16)
    assert predict(full, 200, AdmissionPolicy.PREDICTED, LATENCY).ttft_s == float("inf")
    assert admit([full], 200, HIGH_PRIORITY, AdmissionPolicy.PREDICTED, SLO, LATENCY).rejected is RejectReason.TTFT
    assert admit([full], 60, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY).accepted  # 4 blocks fit


def test_measured_step_inflation_scales_the_predicted_tbt():
    plain = outlook(num_queued=9)
    inflated = InstanceOutlook("a", 0, 9, (), 200.0, OutputLengthEstimate(), step_inflation=3.0)
    assert predict(inflated, 10, AdmissionPolicy.PREDICTED, LATENCY).tbt_s == pytest.approx(
        3.0 * predict(plain, 10, AdmissionPolicy.PREDICTED, LATENCY).tbt_s)
    assert admit([plain], 10, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY).accepted
    assert admit([inflated], 10, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY).rejected is RejectReason.TBT


def test_normal_priority_leaves_the_reserve_share_of_blocks_free():
    slo = SloConfig(Slo(1.0, 0.05), reserve=0.1)
    load = InstanceOutlook("a", 0, 0, (), 0.0, OutputLengthEstimate(), free_blocks_after_queue=20, block_size=16,
                           total_blocks=100)  # normal may use 20 - 10 blocks
    assert admit([load], 15 * 16, 0, AdmissionPolicy.PREDICTED, slo, LATENCY).rejected is RejectReason.TTFT
    assert admit([load], 15 * 16, HIGH_PRIORITY, AdmissionPolicy.PREDICTED, slo, LATENCY).accepted
    assert admit([load], 9 * 16 - 1, 0, AdmissionPolicy.PREDICTED, slo, LATENCY).accepted
