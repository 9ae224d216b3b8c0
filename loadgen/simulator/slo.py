"""SLO outcome of a simulated run (issue 19): goodput, rejected share, wasted prefill and the
accepted requests' TTFT, plus per-second accepted/rejected counts for the oscillation plot.

A request meets the SLO when its TTFT and its TBT (mean time per output token after the first,
as `metrics.RequestLatencies` measures decode) are both within its priority's targets. Rejected
requests are counted apart and never enter the latency figures. Wasted prefill: prompt tokens
prefilled for accepted requests that then missed the SLO (work spent on an answer that failed).
TTFT prediction error: an accepted request's TTFT less the TTFT admission predicted on the
instance it went to (positive: later than predicted), the figure an accepted request's SLO miss
is judged against (the live gateway exports the same: `corral:gateway_ttft_prediction_error_seconds`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from loadgen.simulator.cluster import SimResult
from shared.policy.admission import SloConfig


@dataclass(frozen=True)
class SloMetrics:
    num_requests: int
    accepted: int
    rejected: int
    rejected_share: float
    met_slo: int
    goodput_rps: float  # requests meeting both SLOs per second of the arrival window
    wasted_prefill_tokens: int
    wasted_prefill_share: float  # of all prompt tokens prefilled
    accepted_ttft_p99_s: float
    accepted_tbt_p99_s: float
    makespan_s: float
    ttft_prediction_error_p50_s: float = 0.0  # over accepted requests with a prediction (admission on)
    ttft_prediction_error_p99_s: float = 0.0
    worst_ttft_miss_s: float = 0.0  # the most an accepted request's TTFT exceeded its target by

    def to_json(self) -> dict:
        return asdict(self)


def slo_metrics(result: SimResult, slo: SloConfig) -> SloMetrics:
    met = wasted = prefilled = 0
    ttfts, tbts, errors = [], [], []
    worst_miss = 0.0
    for r in result.finished:
        assert r.first_token_time is not None and r.finished_time is not None, r.request_id
        target = slo.slo_for(result.labels[r.request_id])
        ttft = r.first_token_time - r.arrival_time
        tbt = (r.finished_time - r.first_token_time) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else 0.0
        ttfts.append(ttft)
        tbts.append(tbt)
        worst_miss = max(worst_miss, ttft - target.ttft_s)
        if (predicted := result.predicted_ttft_s.get(r.request_id)) is not None:
            errors.append(ttft - predicted)
        prefilled += r.prompt_len
        if ttft <= target.ttft_s and tbt <= target.tbt_s:
            met += 1
        else:
            wasted += r.prompt_len
    makespan = result.makespan_s
    # Goodput over the arrival window, the same for every policy on one workload (not the
    # makespan: a policy that queues everything would be credited for the drain that follows).
    window = max([r.arrival_time for r in result.finished] + [x.at_s for x in result.rejected], default=0.0)
    n = result.num_requests
    return SloMetrics(
        num_requests=n,
        accepted=len(result.finished),
        rejected=len(result.rejected),
        rejected_share=len(result.rejected) / n if n else 0.0,
        met_slo=met,
        goodput_rps=met / window if window > 0 else 0.0,
        wasted_prefill_tokens=wasted,
        wasted_prefill_share=wasted / prefilled if prefilled else 0.0,
        accepted_ttft_p99_s=float(np.percentile(ttfts, 99)) if ttfts else 0.0,
        accepted_tbt_p99_s=float(np.percentile(tbts, 99)) if tbts else 0.0,
        makespan_s=makespan,
        ttft_prediction_error_p50_s=float(np.percentile(errors, 50)) if errors else 0.0,
        ttft_prediction_error_p99_s=float(np.percentile(errors, 99)) if errors else 0.0,
        worst_ttft_miss_s=worst_miss,
    )


def per_second(result: SimResult) -> tuple[list[int], list[int]]:
    """(accepted, rejected) arrivals in each second of the run."""
    seconds = int(result.makespan_s) + 1
    accepted, rejected = [0] * seconds, [0] * seconds
    for r in result.finished:
        accepted[min(int(r.arrival_time), seconds - 1)] += 1
    for record in result.rejected:
        rejected[min(int(record.at_s), seconds - 1)] += 1
    return accepted, rejected


SLO_HEADER = (f"{'admission':<13} {'goodput':>9} {'met':>6} {'rejected':>9} {'wasted prefill':>14} "
              f"{'P99 TTFT acc':>12} {'P99 TBT acc':>11}")


def slo_row(name: str, m: SloMetrics) -> str:
    return (f"{name:<13} {m.goodput_rps:>7.2f}/s {m.met_slo:>6} {m.rejected_share:>8.1%} "
            f"{m.wasted_prefill_share:>13.1%} {m.accepted_ttft_p99_s:>11.2f}s {m.accepted_tbt_p99_s * 1e3:>9.0f}ms")
