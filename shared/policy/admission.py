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
  - when its prefill completes (`predicted`): the running requests expected to outlast the
    decode steps that fit in the predicted TTFT (at the instance's measured pace); the queued
    requests ahead (prefilled before it) and itself join.

A decode step's time comes from the latency model times the instance's measured step inflation
(its recent steps' time over their decode-only time: the prefill chunks other requests mix into
the steps, which lengthen every decoding request's TBT); both policies use it.

Remaining output of a running request: from the instance's output-length estimate, a bounded
histogram of the output lengths it has served (`OutputLengthEstimate`, log-spaced bins, mixed with
an exponential prior that weighs as a few requests until it has served some). A request that has
produced g tokens is still running after s more steps with probability S(g + s) / S(g), S the
estimate's survival function; `predicted` counts the running requests expected to be there then
(the sum of those probabilities, rounded up). Output lengths are heavy-tailed: a request that ran
long tends to run longer, which a residual taken from the mean (`mean - g`, with a floor) missed —
it expected the long-running batch to empty and admitted too much on prefill-heavy workloads. The
survival is exact for the served distribution: short for a fresh request of a typical instance,
long for one deep in the tail.

`predicted` also prices what admitting does to the requests decoding there: its prefill runs in
their steps (`prefill_interference`: the expected number of running requests it pushes past the
TBT target, from each one's output so far and the survival; refused at one or more, since an
admission gains at most one request within the SLO). With P/D roles a request on a prefill
instance (`hands_off`) decodes on the decode pool: its TBT is the pool's at its hand-off
(`decode_pool`: `predicted` forecasts it with the requests ending by then and those on their way;
`current-load` takes the pool as it is now), or, when the pool will have no room for it, the
prefill instance's own (it degrades to mixed there).

The request is admitted to the instances whose predictions meet the SLO (dispatch then picks
among them) and rejected with a reason when none does. Normal priority must meet the SLO with
`reserve` of it held back (and the same share of the instance's KV blocks left free), high
priority the full SLO and all the blocks: as load rises normal requests are
refused first and high priority last. On a prefill instance of P/D pools the reserve is
`handoff_reserve` (0.3): there the prediction also forecasts the hand-off, and its error is
larger. Measured by `benchmarks/admission.py` on simulated P/D pools (L-M, L-S and ShareGPT-like
lengths, 9 runs each): with 0.2, 3 of 27 runs on seeds 0-2 had an accepted P99 TTFT over the
SLO (up to 2.09 s against 2 s), and 3 of 27 on seeds 3-5 (up to 2.27 s); with 0.3, none of the 54,
at -0.9 to +0.5 % of goodput on long prompts and -0.8 to -2.7 % on ShareGPT-like ones. (0.3 was
picked on seeds 0-2 and checked on 3-5.)
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from shared.messages import MAX_OUTPUT_LENGTH_BINS
from shared.policy.config import HIGH_PRIORITY
from shared.policy.decode_pool import DecodePool, forecast
from shared.policy.prefill_interference import expected_pushed_past_tbt


# `predicted` admits no prompt expected to push this many running requests past the TBT target
# (`prefill_interference`): one admission gains at most one request within the SLO.
MAX_PUSHED = 1.0


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
    handoff_reserve: float = 0.3  # the same on a prefill instance that hands off (P/D pools)

    def __post_init__(self) -> None:
        for name in ("reserve", "handoff_reserve"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    def slo_for(self, priority: int) -> Slo:
        return self.by_priority.get(priority, self.default)

    def reserve_for(self, priority: int, hands_off: bool = False) -> float:
        """The share of the SLO (and of the KV blocks) a request of this priority leaves unused."""
        if priority <= HIGH_PRIORITY:
            return 0.0
        return self.handoff_reserve if hands_off else self.reserve

    def budget_for(self, priority: int, hands_off: bool = False) -> Slo:
        """The targets a prediction must meet at this priority (the SLO less the reserve)."""
        slo = self.slo_for(priority)
        keep = 1.0 - self.reserve_for(priority, hands_off)
        return Slo(slo.ttft_s * keep, slo.tbt_s * keep)


def priority_slos(specs: Iterable[str]) -> dict[int, Slo]:
    """`--slo-priority` values, `PRIORITY:TTFT_S:TBT_S` each: a priority's own targets. PRIORITY is
    an integer (vLLM's: lower is more important) or `high` / `normal` (so `high:0.5:0.05` needs no
    `--slo-priority=-1:…` to get past argparse). A malformed one raises ValueError naming it."""
    found: dict[int, Slo] = {}
    for spec in specs:
        parts = spec.split(":")
        try:
            if len(parts) != 3:
                raise ValueError("three fields")
            named = {"high": HIGH_PRIORITY, "normal": 0}
            priority = named[parts[0]] if parts[0] in named else int(parts[0])
            ttft_s, tbt_s = float(parts[1]), float(parts[2])
            slo = Slo(ttft_s, tbt_s)
        except ValueError as exc:
            raise ValueError(f"bad priority SLO {spec!r} (want PRIORITY:TTFT_S:TBT_S, e.g. high:0.5:0.05): {exc}") from None
        if priority in found:
            raise ValueError(f"priority {priority} has two SLOs")
        found[priority] = slo
    return found


def _output_bin_edges() -> tuple[int, ...]:
    """Lower edges of the output-length bins: 0, 1, then 2^k and 1.5 * 2^k up to 98,304 tokens
    (two bins an octave: a few percent of error on a survival, 34 counts on the wire)."""
    edges = [0, 1]
    for k in range(1, 17):
        edges += [2**k, 3 * 2 ** (k - 1)]
    return tuple(edges)


OUTPUT_BIN_EDGES = _output_bin_edges()
# Bin i holds lengths in [edge i, edge i+1); the last, open one is taken to end at twice its edge.
OUTPUT_BIN_UPPER = (*OUTPUT_BIN_EDGES[1:], 2 * OUTPUT_BIN_EDGES[-1])
NUM_OUTPUT_BINS = len(OUTPUT_BIN_EDGES)
assert NUM_OUTPUT_BINS <= MAX_OUTPUT_LENGTH_BINS


def output_length_bin(tokens: int) -> int:
    return bisect.bisect_right(OUTPUT_BIN_EDGES, max(tokens, 0)) - 1


@dataclass(frozen=True)
class _Survival:
    """The histogram's survival at each bin's lower edge and its integral from there to the end."""

    above: tuple[float, ...]  # requests with length >= edge i (one more entry: 0 past the last bin)
    tail: tuple[float, ...]  # integral of the survival count from edge i to the end


@dataclass
class OutputLengthEstimate:
    """The output lengths an instance has served, as counts in log-spaced bins (lengths uniform
    within a bin), mixed with an exponential prior of mean `prior_mean` that weighs as
    `prior_weight` requests (so one early short request does not swing it, and a request past
    everything served still has the prior's mean left)."""

    prior_mean: float = 256.0
    prior_weight: float = 8.0
    counts: list[int] = field(default_factory=lambda: [0] * NUM_OUTPUT_BINS)
    _table: _Survival | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.counts) != NUM_OUTPUT_BINS:  # another version's bins: the extra ones fold into the last
            folded = list(self.counts[:NUM_OUTPUT_BINS]) + [0] * (NUM_OUTPUT_BINS - len(self.counts))
            folded[-1] += sum(self.counts[NUM_OUTPUT_BINS:])
            self.counts = folded

    def observe(self, output_tokens: int) -> None:
        self.counts[output_length_bin(output_tokens)] += 1
        self._table = None

    @property
    def served(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        return self.remaining(0)

    def still_running(self, generated: int, steps: float) -> float:
        """P(its output outlasts `steps` more tokens | it has produced `generated` and runs on)."""
        now = self._survival(generated)
        if now <= 0.0:  # past everything served and the prior's reach: the prior is memoryless
            return math.exp(-steps / self.prior_mean)
        return self._survival(generated + steps) / now

    def remaining(self, generated: int) -> float:
        """Expected output still to come of a request that has produced `generated` tokens."""
        now = self._survival(generated)
        if now <= 0.0:
            return self.prior_mean
        return self._integral_from(generated) / now

    def _survival(self, x: float) -> float:
        """Requests (the prior's weight included) whose length is past x."""
        prior = self.prior_weight * math.exp(-x / self.prior_mean)
        table = self._survival_table()
        i = output_length_bin(int(x)) if x >= 0 else 0
        low, high = OUTPUT_BIN_EDGES[i], OUTPUT_BIN_UPPER[i]
        if x >= high:
            return prior
        inside = self.counts[i] * (high - max(x, low)) / (high - low)
        return prior + table.above[i + 1] + inside

    def _integral_from(self, x: float) -> float:
        """Integral of `_survival` from x on: the requests' expected tokens still to come past x."""
        prior = self.prior_weight * self.prior_mean * math.exp(-x / self.prior_mean)
        table = self._survival_table()
        i = output_length_bin(int(x)) if x >= 0 else 0
        low, high = OUTPUT_BIN_EDGES[i], OUTPUT_BIN_UPPER[i]
        if x >= high:
            return prior
        left = high - max(x, low)
        inside = left * table.above[i + 1] + self.counts[i] * left * left / (2 * (high - low))
        return prior + inside + table.tail[i + 1]

    def _survival_table(self) -> _Survival:
        if self._table is None:
            above, tail = [0.0] * (NUM_OUTPUT_BINS + 1), [0.0] * (NUM_OUTPUT_BINS + 1)
            for i in reversed(range(NUM_OUTPUT_BINS)):
                width = OUTPUT_BIN_UPPER[i] - OUTPUT_BIN_EDGES[i]
                above[i] = above[i + 1] + self.counts[i]
                tail[i] = tail[i + 1] + width * (above[i + 1] + self.counts[i] / 2)
            self._table = _Survival(tuple(above), tuple(tail))
        return self._table


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
    hands_off: bool = False  # a prefill instance: the request decodes on the decode pool (decode_pool.py)
    prefill_tokens_per_step: int = 2048  # chunked prefill's budget a step (the engine's max_num_batched_tokens)


@dataclass(frozen=True)
class Prediction:
    instance_id: str
    ttft_s: float
    decode_batch: int
    tbt_s: float
    pushed: float = 0.0  # running requests its prefill is expected to push past the TBT target (predicted)


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: tuple[str, ...]  # instances whose predictions meet the SLO; empty when rejected
    rejected: RejectReason | None
    predictions: tuple[Prediction, ...]
    budgets: tuple[Slo, ...] = ()  # the targets each prediction had to meet (the SLO less its reserve)

    @property
    def accepted(self) -> bool:
        return self.rejected is None


@dataclass(frozen=True)
class LatencyFns:
    prefill_s: Callable[[int], float]  # seconds to prefill that many tokens
    decode_s: Callable[[int, int], float]  # seconds for a decode step: (batch size, context tokens)


def predict(outlook: InstanceOutlook, prompt_tokens: int, policy: AdmissionPolicy, latency: LatencyFns,
            reserve_blocks: int = 0, cached_tokens: int = 0) -> Prediction:
    """`cached_tokens`: of the prompt, held in that instance's prefix cache (they are not
    prefilled there; its blocks are still counted whole against the room, as a bound)."""
    assert 0 <= cached_tokens < max(prompt_tokens, 1), (cached_tokens, prompt_tokens)
    running = len(outlook.running_generated)
    step_s = latency.decode_s(running, int(running * outlook.context_tokens_per_request)) if running else 0.0
    queue_s = latency.prefill_s(outlook.queued_prefill_tokens) + _step_in_flight_s(outlook, latency, step_s)
    if -(-(prompt_tokens + 1) // outlook.block_size) + reserve_blocks > outlook.free_blocks_after_queue:
        queue_s = math.inf  # no room now: it would wait for memory (see the module note)
    ttft = queue_s + latency.prefill_s(prompt_tokens - cached_tokens)
    if policy is AdmissionPolicy.PREDICTED and running and math.isfinite(ttft):
        # Decode steps that fit in the TTFT at the instance's measured pace (its steps carry the
        # prefill mixed in: at the decode-only time as many as twice the steps would be counted,
        # and requests dropped that are still there).
        paced_s = step_s * outlook.step_inflation
        steps = ttft / paced_s if paced_s > 0 else 0.0
        expected = sum(outlook.output.still_running(g, steps) for g in outlook.running_generated)
        running = min(running, math.ceil(expected - 1e-9))
    batch = running + outlook.num_queued + 1
    context = int(batch * max(outlook.context_tokens_per_request, float(prompt_tokens)))
    return Prediction(outlook.instance_id, ttft, batch, latency.decode_s(batch, context) * outlook.step_inflation)


def _step_in_flight_s(outlook: InstanceOutlook, latency: LatencyFns, decode_step_s: float) -> float:
    """What is left, on average, of the step running when the request arrives (it starts at the
    next one, and the chunk that step prefills has already left the queue's count): half a step,
    one with a chunk of prefill while there is a queue (a full budget's, or the queue's size when
    smaller), else a decode step at the instance's pace."""
    if outlook.queued_prefill_tokens > 0:
        chunk = min(outlook.queued_prefill_tokens, outlook.prefill_tokens_per_step)
        return 0.5 * (latency.prefill_s(chunk) + decode_step_s)
    return 0.5 * decode_step_s * outlook.step_inflation


def _on_decode_pool(prediction: Prediction, decode: DecodePool, prompt_tokens: int, policy: AdmissionPolicy,
                    latency: LatencyFns, reserve_share: float) -> Prediction:
    if not math.isfinite(prediction.ttft_s):
        return prediction
    ahead = forecast(decode, prediction.ttft_s, prompt_tokens, policy is AdmissionPolicy.PREDICTED, latency,
                     reserve_share)
    if ahead.blocks > ahead.capacity_blocks:  # no room there: it decodes where it prefilled (degraded to mixed)
        return prediction
    return Prediction(prediction.instance_id, prediction.ttft_s, ahead.batch, ahead.tbt_s)


def admit(
    outlooks: Sequence[InstanceOutlook],
    prompt_tokens: int,
    priority: int,
    policy: AdmissionPolicy,
    slo: SloConfig,
    latency: LatencyFns,
    decode: DecodePool | None = None,
    cached_tokens: Mapping[str, int] | None = None,
) -> AdmissionDecision:
    """`decode`: with P/D roles, the decode pool a request on a `hands_off` candidate moves to at
    its first token; its TBT is then the pool's forecast at that time (`decode_pool.forecast`).
    `cached_tokens`: by instance id, the prompt's tokens its prefix cache holds (none where
    absent): only the rest is prefilled there, so only the rest is predicted and pushes the
    requests decoding there."""
    cached = cached_tokens or {}
    if policy is AdmissionPolicy.NONE:
        return AdmissionDecision(tuple(o.instance_id for o in outlooks), None, ())
    if not outlooks:
        return AdmissionDecision((), RejectReason.NO_INSTANCE, ())
    budgets = [slo.budget_for(priority, o.hands_off) for o in outlooks]
    shares = [slo.reserve_for(priority, o.hands_off) for o in outlooks]
    predictions = tuple(predict(o, prompt_tokens, policy, latency, int(share * o.total_blocks),
                                cached.get(o.instance_id, 0))
                        for o, share in zip(outlooks, shares, strict=True))
    if decode is not None and decode.instances:
        predictions = tuple(_on_decode_pool(p, decode, prompt_tokens, policy, latency, share) if o.hands_off else p
                            for o, p, share in zip(outlooks, predictions, shares, strict=True))
    if policy is AdmissionPolicy.PREDICTED:  # and the requests decoding there, which its prefill slows
        predictions = tuple(replace(p, pushed=expected_pushed_past_tbt(o, prompt_tokens - cached.get(o.instance_id, 0),
                                                                       latency, budget.tbt_s))
                            for o, p, budget in zip(outlooks, predictions, budgets, strict=True))
    meets = [(p, budget) for p, budget in zip(predictions, budgets, strict=True) if p.ttft_s <= budget.ttft_s]
    admitted = tuple(p.instance_id for p, budget in meets if p.tbt_s <= budget.tbt_s and p.pushed < MAX_PUSHED)
    if admitted:
        return AdmissionDecision(admitted, None, predictions, tuple(budgets))
    return AdmissionDecision((), RejectReason.TBT if meets else RejectReason.TTFT, predictions, tuple(budgets))
