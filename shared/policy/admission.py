"""Admission control: reject early, before any prefill is spent, when no instance can meet the SLO
(Mooncake's overload-oriented scheduling), as pure functions shared by the simulator, the
scheduler and tests.

Per candidate instance a request gets two predictions:
- TTFT = prefill of what is queued ahead there + prefill of its own prompt (the same terms as
  `prefix_dispatch.predicted_ttft_s`, through the same latency-model `prefill_s`); when the KV
  blocks left after the queue's claims cannot hold its prompt, the instance cannot take it
  (both policies). Predicting the wait for running requests to free memory was tried: with
  decoding requests growing their KV meanwhile it under-predicted (the admitted excess ran into
  preemptions; P99 TTFT error of 15 s in the simulator), so it is left out;
- TBT = one decode step of the batch it will join, with that batch taken either
  - now (`current-load`, Mooncake's baseline: the running requests, plus the queued ones and
    itself), or
  - when its prefill completes (`predicted`): a running request is still there then only if its
    predicted remaining output outlasts the decode steps that fit in the predicted TTFT; the
    queued requests ahead (prefilled before it) and itself join.

A decode step's time comes from the latency model times the instance's measured step inflation
(its recent steps' time over their decode-only time: the prefill chunks other requests mix into
the steps, which lengthen every decoding request's TBT); both policies use it.

Remaining output of a running request: from the instance's output-length estimate, the mean
output length of the requests it has served (`OutputLengthEstimate`, a prior until it has seen
some). A request that has produced g tokens has `max(mean - g, tail_fraction * mean)` left: the
plain difference for the typical request, and a floor for those already past the mean, since
output lengths are heavy-tailed (a request that ran long tends to run longer) — without it a
long-running batch would look as if it were about to empty.

The request is admitted to the instances whose predictions meet the SLO (dispatch then picks
among them) and rejected with a reason when none does. Normal priority must meet the SLO with
`reserve` of it held back (and the same share of the instance's KV blocks left free), high
priority the full SLO and all the blocks: as load rises normal requests are
refused first and high priority last.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.policy.config import HIGH_PRIORITY


class AdmissionPolicy(str, enum.Enum):
    NONE = "none"
    CURRENT_LOAD = "current-load"
    PREDICTED = "predicted"


ADMISSION_POLICY_NAMES = [p.value for p in AdmissionPolicy]


class RejectReason(str, enum.Enum):
    TTFT = "ttft"  # every instance's queued prefill (plus this prompt) is past the TTFT target
    TBT = "tbt"  # the TTFT fits somewhere, but not with a decode batch inside the TBT target
    NO_INSTANCE = "no_instance"  # no candidate at all


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tbt_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLO targets must be positive, got TTFT {self.ttft_s} s, TBT {self.tbt_s} s")


@dataclass(frozen=True)
class SloConfig:
    default: Slo
    by_priority: Mapping[int, Slo] = field(default_factory=dict)  # a priority's own targets
    reserve: float = 0.1  # share of the SLO normal priority may not use (kept for high priority)

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve < 1.0:
            raise ValueError(f"reserve must be in [0, 1), got {self.reserve}")

    def slo_for(self, priority: int) -> Slo:
        return self.by_priority.get(priority, self.default)

    def budget_for(self, priority: int) -> Slo:
        """The targets a prediction must meet at this priority (the SLO less the reserve)."""
        slo = self.slo_for(priority)
        keep = 1.0 if priority <= HIGH_PRIORITY else 1.0 - self.reserve
        return Slo(slo.ttft_s * keep, slo.tbt_s * keep)


@dataclass
class OutputLengthEstimate:
    """Mean output length of the requests an instance has served, starting from a prior that
    weighs as `prior_weight` requests (so one early short request does not swing it)."""

    prior_mean: float = 256.0
    prior_weight: float = 8.0
    served: int = 0
    served_tokens: int = 0

    def observe(self, output_tokens: int) -> None:
        self.served += 1
        self.served_tokens += output_tokens

    @property
    def mean(self) -> float:
        return (self.prior_mean * self.prior_weight + self.served_tokens) / (self.prior_weight + self.served)

    def remaining(self, generated: int, tail_fraction: float = 0.25) -> float:
        mean = self.mean
        return max(mean - generated, tail_fraction * mean)


@dataclass(frozen=True)
class InstanceOutlook:
    """What admission needs of one instance (built from its load and the requests on it)."""

    instance_id: str
    queued_prefill_tokens: int  # prefill still ahead of a new request (prompts waiting or mid-prefill)
    num_queued: int  # requests waiting or mid-prefill: they decode before the new one does
    running_generated: Sequence[int]  # output tokens produced so far by each decoding request
    context_tokens_per_request: float  # mean context of a decoding request (decode step cost)
    output: OutputLengthEstimate
    free_blocks_after_queue: int = 1 << 62  # KV blocks left once the queue has claimed its own
    block_size: int = 16
    step_inflation: float = 1.0  # measured step time / decode-only model time (prefill mixed in)
    total_blocks: int = 0  # the instance's KV blocks (normal priority leaves a reserve of them free)


@dataclass(frozen=True)
class Prediction:
    instance_id: str
    ttft_s: float
    decode_batch: int
    tbt_s: float


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: tuple[str, ...]  # instances whose predictions meet the SLO; empty when rejected
    rejected: RejectReason | None
    predictions: tuple[Prediction, ...]

    @property
    def accepted(self) -> bool:
        return self.rejected is None


@dataclass(frozen=True)
class LatencyFns:
    prefill_s: Callable[[int], float]  # seconds to prefill that many tokens
    decode_s: Callable[[int, int], float]  # seconds for a decode step: (batch size, context tokens)


def predict(outlook: InstanceOutlook, prompt_tokens: int, policy: AdmissionPolicy, latency: LatencyFns,
            reserve_blocks: int = 0) -> Prediction:
    running = len(outlook.running_generated)
    step_s = latency.decode_s(running, int(running * outlook.context_tokens_per_request)) if running else 0.0
    queue_s = latency.prefill_s(outlook.queued_prefill_tokens)
    if -(-(prompt_tokens + 1) // outlook.block_size) + reserve_blocks > outlook.free_blocks_after_queue:
        queue_s = math.inf  # no room now: it would wait for memory (see the module note)
    ttft = queue_s + latency.prefill_s(prompt_tokens)
    if policy is AdmissionPolicy.PREDICTED and running:
        # Decode steps that fit in the TTFT, at the current batch's step time (a lower bound on
        # the steps: mixed steps with prefill are slower, so this keeps requests, never drops more).
        steps = ttft / step_s if step_s > 0 else 0.0
        running = sum(outlook.output.remaining(g) > steps for g in outlook.running_generated)
    batch = running + outlook.num_queued + 1
    context = int(batch * max(outlook.context_tokens_per_request, float(prompt_tokens)))
    return Prediction(outlook.instance_id, ttft, batch, latency.decode_s(batch, context) * outlook.step_inflation)


def admit(
    outlooks: Sequence[InstanceOutlook],
    prompt_tokens: int,
    priority: int,
    policy: AdmissionPolicy,
    slo: SloConfig,
    latency: LatencyFns,
) -> AdmissionDecision:
    if policy is AdmissionPolicy.NONE:
        return AdmissionDecision(tuple(o.instance_id for o in outlooks), None, ())
    if not outlooks:
        return AdmissionDecision((), RejectReason.NO_INSTANCE, ())
    budget = slo.budget_for(priority)
    share = 0.0 if priority <= HIGH_PRIORITY else slo.reserve
    predictions = tuple(predict(o, prompt_tokens, policy, latency, int(share * o.total_blocks)) for o in outlooks)
    meets_ttft = [p for p in predictions if p.ttft_s <= budget.ttft_s]
    admitted = tuple(p.instance_id for p in meets_ttft if p.tbt_s <= budget.tbt_s)
    if admitted:
        return AdmissionDecision(admitted, None, predictions)
    return AdmissionDecision((), RejectReason.TBT if meets_ttft else RejectReason.TTFT, predictions)
