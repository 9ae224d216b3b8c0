"""Admission control at dispatch (issue 19 §1): the scheduler asks the pure policy
(`shared.policy.admission`) which live instances can meet the SLO for a request, and answers
`Refusal.OVERLOADED` with a retry hint (the gateway's 429 with Retry-After and retry-after-ms)
when none can; dispatch then chooses among the admitted ones only.

The outlooks come from the load reports alone: each running request's output so far
(`running_output_tokens`; past the report's cap, or from a llumlet that does not send them, a
request counts as just started) and the histogram of its finished requests' output lengths,
which makes its output-length estimate (the prior, weighed as a few requests, until it has
served some; rebuilt only when the instance's count of finished moves) — the same inputs the
simulator reads from its engines. Step times come from the latency model of `gpu`, times the
instance's step inflation: the pace its report gives (recent decoding steps' wall time, requests
decoded and their context) over the model's decode-only time for that batch.
As the simulator's it carries the prefill mixed into the steps; live it also carries how far the
engine is from the profile (a faster engine than `gpu` gives a ratio below 1), for TBT only.

The loads it reads count the dispatches sent after an instance's latest report was built: the
scheduler's table holds each report with them added back (`shared/unreported_dispatches.py`; a
report that overtook a dispatch would otherwise wipe it).

With P/D roles (a live prefill instance), a request on a prefill instance decodes on the decode
pool: its TBT is the pool's forecast at its hand-off (`shared.policy.decode_pool`), from the
decode instances' reports and the requests the prefill instances' reports show on their way.
The chunked-prefill budget a step (for `predicted`'s prefill interference) is not in the reports:
the default of `InstanceOutlook` (vLLM's 2,048) is taken.

A prompt's prefix cached on an instance (the scheduler's prefix index, from the llumlets' KV
events) is not predicted there: only the rest is prefilled, as the dispatch predicts it. That
needs the prompt's block hashes in the dispatch request (the gateway's `--dispatch-prefix-hashes`);
without them every prompt is predicted whole, as before.

An admitted request's reply carries its predicted TTFT on the chosen instance, which the gateway
compares with the TTFT it measures (`corral:gateway_ttft_prediction_error_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, Counter

from shared.engine_model.latency import LatencyModel
from shared.messages import DispatchReply, DispatchRequest, InstanceRole, LoadReport, Refusal
from shared.policy.admission import (
    AdmissionDecision,
    AdmissionPolicy,
    InstanceOutlook,
    LatencyFns,
    OutputLengthEstimate,
    RejectReason,
    SloConfig,
    admit,
)
from shared.policy.decode_pool import DecodePool, decode_loads, in_flight_of, prefill_loads
from shared.policy.prefix_dispatch import PrefixIndex, cached_tokens, matched_blocks, queued_prefill_tokens

MIN_RETRY_S, MAX_RETRY_S = 0.1, 30.0
MIN_INFLATION, MAX_INFLATION = 0.01, 100.0  # a measured ratio outside these is a broken clock, not a pace
MAX_REMEMBERED = 4096  # instances' estimates kept (a cache: cleared past this)
NO_ROOM_RETRY_S = 1.0  # no instance has room for the prompt now: a second is a few requests' ends


@dataclass(frozen=True)
class AdmissionSettings:
    policy: AdmissionPolicy
    slo: SloConfig
    gpu: str = "A10"  # latency profile for the predictions
    prior_output_len: float = 256.0


class DispatchAdmission:
    def __init__(self, settings: AdmissionSettings, registry: CollectorRegistry, prefixes: PrefixIndex) -> None:
        self.settings = settings
        self._prefixes = prefixes  # the llumlets' prefix caches (the scheduler's index of their KV events)
        model = LatencyModel(settings.gpu)
        self._latency = LatencyFns(prefill_s=lambda n: model.prefill_ms(n) / 1e3 if n > 0 else 0.0,
                                   decode_s=lambda bs, ctx: model.decode_ms(bs, ctx) / 1e3)
        self._estimates = _Estimates(settings.prior_output_len)
        self.rejections = Counter("corral:scheduler_admission_rejections",
                                  "Requests refused by admission control (429), by reason", ["reason"],
                                  registry=registry)
        for reason in RejectReason:
            self.rejections.labels(reason.value)

    def check(self, loads: Sequence[LoadReport], request: DispatchRequest
              ) -> tuple[DispatchRequest, DispatchReply | None, dict[str, float]]:
        """The request with the instances that cannot meet the SLO excluded, or a refusal; and
        the predicted TTFT on each admitted instance."""
        live = [load for load in loads if not load.draining and load.instance_id not in request.exclude]
        if not live:  # nothing to predict: dispatch answers as without admission (no instance, not overload)
            return request, None, {}
        matched = matched_blocks(request, self._prefixes)  # ({} for a request without block hashes)
        cached = {load.instance_id: cached_tokens(load, request, matched) for load in live}
        decision = admit([self._outlook(load) for load in live], request.num_prompt_tokens, request.priority,
                         self.settings.policy, self.settings.slo, self._latency, self._decode_pool(loads), cached)
        if decision.accepted:
            admitted = set(decision.admitted)
            others = [load.instance_id for load in live if load.instance_id not in admitted]
            predicted = {p.instance_id: p.ttft_s for p in decision.predictions if p.instance_id in admitted}
            return (request if not others else _with_exclude(request, others)), None, predicted
        assert decision.rejected is not None
        self.rejections.labels(decision.rejected.value).inc()
        return request, DispatchReply(
            rejected=f"overloaded: no instance can meet the SLO ({decision.rejected.value})",
            retry_after_s=self._retry_after_s(decision),
            reason=Refusal.OVERLOADED,
        ), {}

    def _outlook(self, load: LoadReport) -> InstanceOutlook:
        running_blocks = sum(level.running_blocks for level in load.by_priority)
        context = running_blocks * load.block_size / load.num_running if load.num_running else 0.0
        free = load.num_blocks_free - load.waiting_demand_blocks - load.committed_blocks - load.reserved_blocks
        generated = list(load.running_output_tokens[: load.num_running])
        generated += [0] * (load.num_running - len(generated))
        output = self._estimates.of(load)
        return InstanceOutlook(load.instance_id, queued_prefill_tokens(load), load.num_waiting, generated, context,
                               output, free, load.block_size, self._inflation(load), load.num_blocks_total,
                               hands_off=load.role is InstanceRole.PREFILL)

    def _decode_pool(self, loads: Sequence[LoadReport]) -> DecodePool | None:
        """With P/D roles, the decode pool and the requests on their way to it (the prefill
        instances' loads: their reports with the dispatches to them they do not show yet)."""
        decode = decode_loads(loads)
        if not decode:
            return None
        prefill = prefill_loads(loads)
        num, blocks = in_flight_of(prefill)
        last_landing_s = max((self._latency.prefill_s(queued_prefill_tokens(load)) for load in prefill),
                             default=0.0)
        return DecodePool([self._outlook(load) for load in decode], num, blocks, last_landing_s)

    def _inflation(self, load: LoadReport) -> float:
        """The instance's recent step time over the model's decode-only step for the batch it
        decoded (1.0 before it reported a decoding step)."""
        if load.step_time_s <= 0.0 or load.step_decode_batch <= 0.0:
            return 1.0
        modelled = self._latency.decode_s(max(1, round(load.step_decode_batch)), round(load.step_decode_context))
        return min(max(load.step_time_s / modelled, MIN_INFLATION), MAX_INFLATION) if modelled > 0 else 1.0

    def _retry_after_s(self, decision: AdmissionDecision) -> float:
        """How long until the nearest instance's predicted TTFT is back within its target."""
        excess = min((p.ttft_s - budget.ttft_s for p, budget in zip(decision.predictions, decision.budgets, strict=True)),
                     default=math.inf)
        if not math.isfinite(excess) or excess <= 0:  # no room now, or a TBT refusal
            return NO_ROOM_RETRY_S
        return min(max(excess, MIN_RETRY_S), MAX_RETRY_S)


class _Estimates:
    """Each instance's output-length estimate, from its latest report's histogram (kept while
    its count of finished requests stays the same: the survival table is built once per change)."""

    def __init__(self, prior_output_len: float) -> None:
        self._prior = prior_output_len
        self._by_instance: dict[str, tuple[int, OutputLengthEstimate]] = {}

    def of(self, load: LoadReport) -> OutputLengthEstimate:
        known = self._by_instance.get(load.instance_id)
        if known is not None and known[0] == load.num_finished_total:
            return known[1]
        estimate = OutputLengthEstimate(prior_mean=self._prior, counts=list(load.finished_output_histogram))
        if len(self._by_instance) > MAX_REMEMBERED:  # instances come and go: forget the old ones
            self._by_instance.clear()
        self._by_instance[load.instance_id] = (load.num_finished_total, estimate)
        return estimate


def _with_exclude(request: DispatchRequest, instance_ids: list[str]) -> DispatchRequest:
    return msgspec.structs.replace(request, exclude=[*request.exclude, *instance_ids])
