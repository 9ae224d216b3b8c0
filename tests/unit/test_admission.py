"""Admission control (shared/policy/admission.py) on hand-built instance loads."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shared.policy.admission import (
    NUM_OUTPUT_BINS,
    OUTPUT_BIN_EDGES,
    AdmissionPolicy,
    InstanceOutlook,
    LatencyFns,
    OutputLengthEstimate,
    RejectReason,
    Slo,
    SloConfig,
    admit,
    output_length_bin,
    predict,
)
from shared.policy.config import HIGH_PRIORITY

# 1 ms per prefill token; a decode step of 10 ms + 1 ms per request in the batch.
LATENCY = LatencyFns(prefill_s=lambda n: n * 1e-3 if n > 0 else 0.0, decode_s=lambda bs, ctx: 0.010 + 0.001 * bs)
SLO = SloConfig(Slo(ttft_s=1.0, tbt_s=0.050), reserve=0.0)


def served(lengths, prior_mean=100.0, prior_weight=1.0) -> OutputLengthEstimate:
    est = OutputLengthEstimate(prior_mean=prior_mean, prior_weight=prior_weight)
    for n in lengths:
        est.observe(int(n))
    return est


def outlook(iid="a", queued=0, num_queued=0, generated=(), mean=100.0, output=None, inflation=1.0):
    return InstanceOutlook(iid, queued, num_queued, tuple(generated), 200.0,
                           output or OutputLengthEstimate(prior_mean=mean, prior_weight=1.0),
                           step_inflation=inflation)


def test_ttft_is_queued_prefill_plus_own_prompt_plus_half_the_step_in_flight():
    # The step running at arrival carries a chunk of the queue (300 tokens: all of it fits the
    # budget) that has already left the queue's count: on average half of it is still to run.
    p = predict(outlook(queued=300), 200, AdmissionPolicy.PREDICTED, LATENCY)
    assert p.ttft_s == pytest.approx(0.3 + 0.2 + 0.15)
    # With nothing queued the step in flight is a decode step (20 ms with 10 running, at 2x pace).
    idle = predict(outlook(generated=[5] * 10, inflation=2.0), 200, AdmissionPolicy.PREDICTED, LATENCY)
    assert idle.ttft_s == pytest.approx(0.2 + 0.5 * 0.020 * 2.0)


def test_only_the_uncached_part_of_the_prompt_is_predicted_where_its_prefix_is_cached():
    # 900 prompt tokens: 0.9 s of prefill; 800 of them cached on "b" (0.1 s left to prefill there).
    cold = predict(outlook("a"), 900, AdmissionPolicy.PREDICTED, LATENCY)
    warm = predict(outlook("b"), 900, AdmissionPolicy.PREDICTED, LATENCY, cached_tokens=800)
    assert cold.ttft_s == pytest.approx(0.9) and warm.ttft_s == pytest.approx(0.1)
    # Behind a 300-token queue the whole prompt misses the 1 s target; its uncached rest does not.
    loads = [outlook("a", queued=300), outlook("b", queued=300)]
    d = admit(loads, 900, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY, cached_tokens={"b": 800})
    assert d.admitted == ("b",)
    assert not admit(loads, 900, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY).accepted
    with pytest.raises(AssertionError):  # at least the last token is prefilled, as the engines do
        predict(outlook("b"), 900, AdmissionPolicy.PREDICTED, LATENCY, cached_tokens=900)


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
    # 1.275 s TTFT (0.9 s of prefill, half a step in flight with a 700-token chunk) spans 25
    # steps (50 ms at 40). The instance serves 10 or 3,000 tokens, half
    # and half (mean ~1,500: a mean-based residual keeps all 40). The 30 at 100 tokens are past
    # every short one: all stay. The 10 at 4 tokens are short (ended in 18 steps) or long by even
    # odds: 5 stay. 35 (36 with the prior's sliver) and itself step in 46-47 ms.
    output = served([10] * 1000 + [3000] * 1000)
    load = outlook(queued=700, generated=[100] * 30 + [4] * 10, output=output)
    slo = SloConfig(Slo(ttft_s=1.5, tbt_s=0.050), reserve=0.0)
    current = admit([load], 200, 0, AdmissionPolicy.CURRENT_LOAD, slo, LATENCY)
    predicted = admit([load], 200, 0, AdmissionPolicy.PREDICTED, slo, LATENCY)
    assert current.rejected is RejectReason.TBT and current.predictions[0].decode_batch == 41
    assert predicted.predictions[0].decode_batch in (36, 37)
    assert predicted.accepted
    assert output.still_running(100, 25) == pytest.approx(1.0, abs=1e-3)
    assert output.still_running(4, 25) == pytest.approx(0.5, abs=1e-3)


def test_predicted_keeps_long_running_requests_of_a_heavy_tail():
    # A heavy-tailed instance (Pareto from 20 tokens, alpha 1.25: mean ~100): a request 500 tokens
    # in has far more than the mean left, so a long-running batch does not empty during a prefill.
    # 45 running step in 55 ms; a 2.5 s TTFT (1.5 s of queue, 0.2 s of prompt, half a step with a
    # 1,515-token chunk in flight) spans 45 steps. The mean-based residual
    # (`max(mean - g, mean / 4)`, ~25 tokens) dropped them all and admitted; by the survival
    # (500 / 545)^1.25 ~ 90 % of them are still there, past the TBT target.
    rng = np.random.default_rng(0)
    output = served(np.minimum(np.rint(20 * (1 + rng.pareto(1.25, 20_000))), 60_000))
    slo = SloConfig(Slo(ttft_s=3.0, tbt_s=0.050), reserve=0.0)
    load = outlook(queued=1515, generated=[500] * 45, output=output)
    assert max(output.mean - 500, 0.25 * output.mean) < 45  # the old residual: all end during the prefill
    assert output.still_running(500, 45) == pytest.approx((500 / 545) ** 1.25, abs=0.03)
    assert 41 <= predict(load, 200, AdmissionPolicy.PREDICTED, LATENCY).decode_batch <= 44
    assert admit([load], 200, 0, AdmissionPolicy.PREDICTED, slo, LATENCY).rejected is RejectReason.TBT


def test_predicted_counts_the_steps_at_the_measured_pace():
    # Served lengths uniform on 1..60; 40 requests 30 tokens in. At the decode-only pace 18 steps
    # fit in the 0.9 s prefill, at 3x inflation 6: more of them are still there.
    output = served(range(1, 61))
    fast = predict(outlook(queued=700, generated=[30] * 40, output=output), 200, AdmissionPolicy.PREDICTED, LATENCY)
    slow = predict(outlook(queued=700, generated=[30] * 40, output=output, inflation=3.0), 200,
                   AdmissionPolicy.PREDICTED, LATENCY)
    assert fast.decode_batch < slow.decode_batch <= 41


def test_queued_requests_join_the_batch_in_both_policies():
    load = outlook(queued=100, num_queued=45)
    for policy in (AdmissionPolicy.CURRENT_LOAD, AdmissionPolicy.PREDICTED):
        assert predict(load, 10, policy, LATENCY).decode_batch == 46


def test_high_priority_is_rejected_last():
    slo = SloConfig(Slo(ttft_s=1.0, tbt_s=0.050), reserve=0.2)  # normal must predict <= 0.8 s
    load = outlook(queued=500)  # 0.95 s with a 200-token prompt (0.25 s: half the step in flight)
    assert admit([load], 200, 0, AdmissionPolicy.PREDICTED, slo, LATENCY).rejected is RejectReason.TTFT
    assert admit([load], 200, HIGH_PRIORITY, AdmissionPolicy.PREDICTED, slo, LATENCY).accepted


def test_a_prefill_instance_of_pd_pools_keeps_the_larger_handoff_reserve():
    slo = SloConfig(Slo(ttft_s=1.0, tbt_s=0.050), reserve=0.1, handoff_reserve=0.2)
    mixed = outlook(queued=420)  # predicted ~0.85 s with a 200-token prompt: within 0.9 s, not 0.8 s
    prefill = replace(mixed, instance_id="p", hands_off=True)
    ttft = predict(mixed, 200, AdmissionPolicy.PREDICTED, LATENCY).ttft_s
    assert 0.8 < ttft <= 0.9
    decision = admit([mixed, prefill], 200, 0, AdmissionPolicy.PREDICTED, slo, LATENCY)
    assert decision.admitted == (mixed.instance_id,)
    assert [b.ttft_s for b in decision.budgets] == pytest.approx([0.9, 0.8])
    assert admit([prefill], 200, HIGH_PRIORITY, AdmissionPolicy.PREDICTED, slo, LATENCY).accepted  # no reserve
    with pytest.raises(ValueError, match="handoff_reserve"):
        SloConfig(Slo(1.0, 0.05), handoff_reserve=1.0)


def test_per_priority_slo_override():
    slo = SloConfig(Slo(1.0, 0.05), by_priority={HIGH_PRIORITY: Slo(0.2, 0.05)}, reserve=0.0)
    load = outlook(queued=300)
    assert admit([load], 200, 0, AdmissionPolicy.PREDICTED, slo, LATENCY).accepted
    assert admit([load], 200, HIGH_PRIORITY, AdmissionPolicy.PREDICTED, slo, LATENCY).rejected is RejectReason.TTFT


def test_no_candidate_is_a_rejection():
    assert admit([], 10, 0, AdmissionPolicy.PREDICTED, SLO, LATENCY).rejected is RejectReason.NO_INSTANCE


def test_output_estimate_moves_from_the_prior_to_what_was_served():
    est = OutputLengthEstimate(prior_mean=256.0, prior_weight=8.0)
    assert est.mean == pytest.approx(256.0) and est.remaining(1000) == pytest.approx(256.0)  # memoryless prior
    for _ in range(992):
        est.observe(10)
    assert est.served == 992
    assert est.mean == pytest.approx((256 * 8 + 992 * 10) / 1000)  # 10 is in bin [8, 12), taken as uniform: 10
    assert est.still_running(0, 20) == pytest.approx(8 / 1000, rel=0.1)  # only the prior's tail outlasts 20
    assert est.remaining(10_000) == pytest.approx(256.0)  # past everything served: the prior's mean


def test_bins_are_log_spaced_and_cover_every_length():
    assert OUTPUT_BIN_EDGES[:8] == (0, 1, 2, 3, 4, 6, 8, 12) and len(OUTPUT_BIN_EDGES) == NUM_OUTPUT_BINS
    assert [output_length_bin(n) for n in (0, 1, 5, 12, 10**9)] == [0, 1, 4, 7, NUM_OUTPUT_BINS - 1]
    other = OutputLengthEstimate(counts=[1] * (NUM_OUTPUT_BINS + 3))  # another version's longer histogram
    assert len(other.counts) == NUM_OUTPUT_BINS and other.counts[-1] == 4 and other.served == NUM_OUTPUT_BINS + 3


@pytest.mark.parametrize("g", [0, 50, 300, 600, 1000, 2000])
def test_residual_of_an_exponential_is_its_mean_at_any_age(g):
    lengths = np.rint(np.random.default_rng(1).exponential(400.0, 50_000))
    est = served(lengths, prior_weight=1.0)
    # Deep in the tail (2.5 and 5 means) a bin spans a third to half of a mean and lengths are
    # taken as uniform in it: the residual comes out long by up to a third (on the safe side).
    assert est.remaining(g) == pytest.approx(400.0, rel=0.06 if g <= 600 else 0.35)
    assert est.remaining(g) >= 0.97 * 400.0
    assert est.still_running(g, 100) == pytest.approx(np.exp(-100 / 400), abs=0.05)


def test_residual_of_a_uniform_shrinks_and_of_a_pareto_grows():
    uniform = served(np.random.default_rng(2).integers(1, 1001, 50_000), prior_weight=1.0)
    for g in (0, 200, 500):
        assert uniform.remaining(g) == pytest.approx((1000 - g) / 2, rel=0.08)
    assert 40 < uniform.remaining(900) < 70  # 50: the last bin, [768, 1024), is taken as filled to its end
    assert uniform.still_running(600, 200) == pytest.approx(0.5, abs=0.05)
    # Pareto, x_min 50, alpha 2: past x_min the expected excess is g / (alpha - 1) = g.
    pareto = served(np.rint(50 * (1 + np.random.default_rng(3).pareto(2.0, 200_000))), prior_weight=1.0)
    for g in (100, 400, 1000):
        assert pareto.remaining(g) == pytest.approx(g, rel=0.2)
    assert pareto.still_running(400, 400) == pytest.approx(0.25, abs=0.04)  # (g / (g + s))^alpha


def test_survival_matches_the_served_sample():
    lengths = np.rint(np.random.default_rng(4).lognormal(4.0, 1.2, 50_000))
    est = served(lengths, prior_weight=1.0)
    for g, s in ((0, 30), (40, 60), (200, 300)):
        alive = lengths[lengths > g]
        assert est.still_running(g, s) == pytest.approx(np.mean(alive > g + s), abs=0.03)
        assert est.remaining(g) == pytest.approx(np.mean(alive - g), rel=0.06)


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
