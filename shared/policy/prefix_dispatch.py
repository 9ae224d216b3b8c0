"""Prefix-aware dispatch (Mooncake's conductor, with Llumnix's freeness as the load guard) and
the two cache-affinity baselines, as pure functions over load reports and a prefix index.

- `choose_by_predicted_ttft` (corral-prefix): per instance, the predicted time to first token =
  prefill of what is queued ahead there + prefill of the request's uncached suffix (its longest
  cached prefix from the index), plus a recompute charge: where less of the prefix is cached than
  on its best holder, the prefill done again there also delays whoever queues behind it, so that
  extra prefill is counted once more (`recompute_weight`), and more while every instance that
  may take the request has prefill queued (`saturation_weight`: no idle capacity absorbs the
  extra work then, so every later request waits for it). An instance without room for the
  request after its queue (dispatch freeness < 0, or too few blocks left for its uncached suffix)
  is charged the wait for the blocks it lacks (`room_wait_weight`; infinite: instances with room
  always first, whatever the others' queues or caches). The queue and the missing blocks grow
  with every request dispatched there (`account_dispatch`), so affinity alone never piles a
  popular prefix onto one instance.
- `choose_longest_prefix` (prefix-only): the longest cached prefix wins, ties by dispatch
  freeness: what a pure cache-affinity router does (it piles).
- `choose_min_kv_cost` (kv-cost): NVIDIA Dynamo's KV router cost, weight × prefill blocks
  (queued + the request's uncached ones) + decode blocks (held by running requests); lowest wins.

The index answers, once per decision, which instances hold how many of a request's leading block
hashes: the simulator reads the instances' caches through it; `shared.prefix_index` is the one a
live scheduler feeds from the llumlets' KV events (O(blocks matched), not O(instances)). Hashes
are in the request's own block size (`DispatchRequest.prefix_block_size`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from shared.messages import DispatchRequest, LoadReport
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import DispatchDecision, blocks_for_tokens, dispatch_score, dispatchable, pick_tied


class PrefixIndex(Protocol):
    def matches(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
        """Instance -> how many leading `block_hashes` it holds (instances holding none may be
        left out)."""
        ...


class EmptyPrefixIndex:
    def matches(self, block_hashes: Sequence[int]) -> Mapping[str, int]:
        return {}


@dataclass(frozen=True)
class PrefixContext:
    index: PrefixIndex
    prefill_s: Callable[[int], float]  # seconds to prefill that many tokens (the latency model)
    kv_cost_overlap_weight: float = 1.0  # Dynamo's overlap_score_weight
    ttft_tie_s: float = 1e-3  # predictions this close are a tie, broken by freeness
    # corral-prefix: the prefill an instance would do beyond the best holder's, counted this many
    # times more (0: the request's own TTFT only). 1 on the simulated A100s' high-load sweep: hit
    # rate and P99 TTFT closer to prefix-only's where it does not pile; 4 (in a first form of the
    # charge) piled a live burst.
    recompute_weight: float = 1.0
    # corral-prefix: an instance without room for the request waits for running requests to free
    # the blocks it lacks. A saturated instance frees blocks no faster than it fills them, at
    # most at its prefill pace, so that wait is at least the prefill of as many tokens as the
    # missing blocks hold: charged this many times (inf: instances with room always rank first,
    # the strict tier). With the strict tier a burst piled onto the last instances with room
    # (a queue predicted at 5 s beside an instance 64 blocks short predicting 0.3 s) on simulated A100s.
    room_wait_weight: float = 1.0
    # corral-prefix: while every instance that may take the request has prefill queued, the
    # recompute charge's weight rises, up to (1 + this) times (`recompute_weight_for`; 0: never).
    # With no idle capacity the prefill done again delays the requests that reach the fleet
    # before it drains. An idle instance anywhere turns it off, so a burst onto one holder
    # spreads as before. 4 on the simulated sweeps: at A100 high load its P99 TTFT fell by up to
    # 31 % (the lowest of every policy at every rate and seed since) and its hit rate rose 5-8
    # points; on A10s it stayed within 1.05x of the best other at every rate on seed means.
    saturation_weight: float = 4.0
    # corral-prefix: where the instance tells its waiting prefill in tokens (`queued_prefill_tokens`;
    # both engines with prefix caching), a waiting prompt's cached prefix counts this share of its
    # prefill in the queue ahead (1: whole, as a report without token counts; 0: only what it will
    # compute), and on every instance, told or not, each request it holds or queues counts as
    # `held_request_tokens` of prefill more (counted only where told, a mixed fleet read the
    # untold instances as emptier: simulated A100s, 4 seeds, P99 TTFT 1.17x with every other
    # instance untold, 0.86x of that once counted on all; an all-untold fleet 0.93x of before;
    # A10s within 1.00x +- 0.03). That term stands for what a prefill-only prediction lacks:
    # every request there joins the steps a new one's prefill runs in, and a holder's many cheap
    # prompts make a long decode batch. Counting cached prefixes whole stood in for it before
    # (B = 1, R = 0): B = 0 alone put system-prompts' P99 at 1.08x and piled the live burst test
    # 19-20 of 24 onto the holder.
    # B = 0, R = 256 against B = 1, R = 0 (benchmarks/prefix_dispatch.py, 8 seeds, geometric mean
    # of P99 TTFT): A100 0.91x (conversation 0.91x, system-prompts 0.92x; 96-128/s 0.61-0.69x),
    # A10 1.00x (Mooncake 0.96x); R = 128 A100 0.94x, R = 384 0.91x; the burst test 10-15 of 24.
    cached_queue_weight: float = 0.0
    held_request_tokens: float = 256.0

    def __post_init__(self) -> None:
        for name in ("recompute_weight", "saturation_weight", "held_request_tokens"):
            weight = getattr(self, name)
            if not (weight >= 0.0 and math.isfinite(weight)):
                raise ValueError(f"{name.replace('_', ' ')} must be a finite number >= 0, got {weight}")
        if not 0.0 <= self.cached_queue_weight <= 1.0:
            raise ValueError(f"cached queue weight must be a number from 0 to 1, got {self.cached_queue_weight}")
        if not self.room_wait_weight >= 0.0:
            raise ValueError(f"room wait weight must be a number >= 0 or inf, got {self.room_wait_weight}")

    def queue_tokens(self, load: LoadReport) -> int:
        """The prefill ahead of a new request on that instance, as this context counts it."""
        return queued_prefill_tokens(load, self.cached_queue_weight, self.held_request_tokens)

    @property
    def rooms_first(self) -> bool:
        """The strict tier: every instance with room ahead of every instance without."""
        return math.isinf(self.room_wait_weight)


DEFAULT_RECOMPUTE_WEIGHT = PrefixContext.recompute_weight
DEFAULT_ROOM_WAIT_WEIGHT = PrefixContext.room_wait_weight
DEFAULT_SATURATION_WEIGHT = PrefixContext.saturation_weight
DEFAULT_CACHED_QUEUE_WEIGHT = PrefixContext.cached_queue_weight
DEFAULT_HELD_REQUEST_TOKENS = PrefixContext.held_request_tokens


def matched_blocks(request: DispatchRequest, index: PrefixIndex) -> Mapping[str, int]:
    """The index's answer for the request (once per decision)."""
    if not request.block_hashes or request.prefix_block_size < 1:
        return {}
    return index.matches(request.block_hashes)


def cached_tokens(load: LoadReport, request: DispatchRequest, matched: Mapping[str, int]) -> int:
    """Prompt tokens the instance holds in its cache."""
    return _tokens_of(matched.get(load.instance_id, 0), request)


def _tokens_of(blocks: int, request: DispatchRequest) -> int:
    """Prompt tokens in that many matched blocks (at most all but the last prompt token)."""
    return min(blocks * request.prefix_block_size, max(request.num_prompt_tokens - 1, 0)) if blocks else 0


def queued_prefill_tokens(load: LoadReport, cached_weight: float = 1.0, per_request: float = 0.0) -> int:
    """Prefill still ahead of a new request there: the waiting prompts' demand and what admitted
    prompts have still to prefill (both in blocks). Where the instance tells what its waiting
    prompts will prefill in tokens (`waiting_prefill_tokens`), their cached prefixes count
    `cached_weight` of theirs (`PrefixContext.cached_queue_weight`; 1: whole blocks, as untold).
    Each request it holds or queues counts `per_request` tokens more, told or not
    (`PrefixContext.held_request_tokens`: every report counts its requests)."""
    waiting = load.waiting_demand_blocks * load.block_size
    held = per_request * (load.num_waiting + load.num_running)
    if load.waiting_prefill_tokens is not None and cached_weight < 1.0:
        uncached = min(load.waiting_prefill_tokens, waiting)
        waiting = uncached + round(cached_weight * (waiting - uncached) + held)
    else:
        waiting += round(held)
    return waiting + load.committed_blocks * load.block_size


def least_prefill_s(request: DispatchRequest, context: PrefixContext, matched: Mapping[str, int]) -> float:
    """Prefill of the request's uncached suffix on the instance holding most of its prefix (once
    per decision: the recompute charge is measured from it)."""
    return context.prefill_s(request.num_prompt_tokens - _tokens_of(max(matched.values(), default=0), request))


def recompute_weight_for(request: DispatchRequest, context: PrefixContext, shortest_queue_tokens: int) -> float:
    """The recompute charge's weight for one decision: `recompute_weight` × (1 +
    `saturation_weight` × s), s = the shortest prefill queue among the instances that may take
    the request ÷ the request's own prefill, at most 1. That queue is the time before any of them
    can start more work, and about s requests of this size reach each meanwhile: prefill done
    again now delays them. s = 0 while any of them is idle; the queue is counted as
    `PrefixContext.queue_tokens` counts it, so with `held_request_tokens` an instance holding
    requests counts as queued (the defaults were measured so). Capped because an instance that
    does not tell its waiting prefill in tokens (one without a prefix cache, an older llumlet)
    has its queue counted in its prompts' blocks, cached ones included, so a holder's queue
    reads longer than it is: an uncapped charge grew with that error and piled a burst onto the
    holder (26 of 64 where 8 instances share one system prompt; capped, 13, and 12 with the
    held-request term now counted there too; unraised, 9)."""
    own_s = context.prefill_s(request.num_prompt_tokens)
    if not context.saturation_weight or shortest_queue_tokens <= 0 or own_s <= 0:
        return context.recompute_weight
    saturation = min(1.0, context.prefill_s(shortest_queue_tokens) / own_s)
    return context.recompute_weight * (1.0 + context.saturation_weight * saturation)


def predicted_ttft_s(load: LoadReport, request: DispatchRequest, context: PrefixContext,
                     matched: Mapping[str, int] | None = None) -> float:
    if matched is None:
        matched = matched_blocks(request, context.index)
    queue_s, own_s = _prefill_terms_s(load, request, context, matched)
    return queue_s + own_s


def _prefill_terms_s(load: LoadReport, request: DispatchRequest, context: PrefixContext,
                     matched: Mapping[str, int]) -> tuple[float, float]:
    """(prefill queued ahead there, prefill of the request's uncached suffix there)."""
    uncached = request.num_prompt_tokens - cached_tokens(load, request, matched)
    return context.prefill_s(context.queue_tokens(load)), context.prefill_s(uncached)


def choose_by_predicted_ttft(
    loads: Sequence[LoadReport], request: DispatchRequest, config: PolicyConfig, context: PrefixContext
) -> DispatchDecision:
    live = dispatchable(loads, request)
    if isinstance(live, DispatchDecision):
        return live
    matched = matched_blocks(request, context.index)
    least_s = least_prefill_s(request, context, matched)
    shortest = min(context.queue_tokens(load) for load in live)
    weight = recompute_weight_for(request, context, shortest)
    return pick_predicted([ttft_rank(load, request, config, context, matched, least_s, weight) for load in live],
                          request, config, context, matched)


class TtftRank(NamedTuple):
    """One instance's place in a decision; ascending = better."""

    behind_rooms: bool  # without room, under the strict tier: after every instance with room
    cost_s: float  # predicted TTFT + recompute charge (+ the room wait's charge, unless strict)
    neg_score: float  # -dispatch score: the freer instance first among near-equal costs
    instance_id: str
    uncharged_s: float  # cost_s without the room wait's charge: a lower bound an index may walk by


def ttft_rank(load: LoadReport, request: DispatchRequest, config: PolicyConfig, context: PrefixContext,
              matched: Mapping[str, int], least_prefill: float, recompute_weight: float | None = None) -> TtftRank:
    """`least_prefill`: `least_prefill_s` of the decision; `recompute_weight`: its
    `recompute_weight_for` (None: the context's own, unraised)."""
    if recompute_weight is None:
        recompute_weight = context.recompute_weight
    score = dispatch_score(load, config.headroom_blocks)
    uncached = request.num_prompt_tokens - cached_tokens(load, request, matched)
    missing = missing_blocks(load, score, blocks_for_tokens(uncached + 1, load.block_size))
    queue_s, own_s = _prefill_terms_s(load, request, context, matched)  # predicted TTFT = their sum
    cost = queue_s + own_s + recompute_weight * max(0.0, own_s - least_prefill)
    if missing and context.rooms_first:
        return TtftRank(True, cost, -score, load.instance_id, cost)
    wait = context.room_wait_weight * context.prefill_s(missing * load.block_size) if missing else 0.0
    return TtftRank(False, cost + wait, -score, load.instance_id, cost)


def missing_blocks(load: LoadReport, score: float, request_blocks: int) -> int:
    """Blocks the instance lacks to take the request after its queue (0: it has room): the
    request's new blocks beyond those left after the queue's claims, or the dispatch freeness
    deficit (which counts the priority headroom), whichever is larger. A draining instance (its
    score -inf) takes work only when none serving may: it lacks all the request's blocks."""
    if score < 0:
        deficit = request_blocks if math.isinf(score) else math.ceil(-score)
    else:
        deficit = 0
    return max(request_blocks - _free_after_queue(load), deficit, 0)


def pick_predicted(ranked: list[TtftRank], request: DispatchRequest, config: PolicyConfig,
                   context: PrefixContext, matched: Mapping[str, int]) -> DispatchDecision:
    """The choice among ranked instances: the best class (room first, under the strict tier), its
    lowest cost, and near-equal costs (`ttft_tie_s`) broken by freeness, then by the request's
    hash. Needs every instance of the best class within the tie band; the others may be left out.
    `matched`: the decision's index answer (the choice's cached tokens go with it)."""
    ranked.sort()
    best = ranked[0]
    band = [r for r in ranked if r.behind_rooms == best.behind_rooms and r.cost_s <= best.cost_s + context.ttft_tie_s]
    if len(band) > 1:  # near-equal costs: the freer instance, then the request's hash
        freest = min(r.neg_score for r in band)
        band = [r for r in band if r.neg_score <= freest + config.tie_epsilon]
    return cached_decision(pick_tied([r.instance_id for r in band], request), request, matched)


def cached_decision(instance_id: str, request: DispatchRequest, matched: Mapping[str, int]) -> DispatchDecision:
    """The decision for `instance_id`, with the prompt tokens its cache holds (`account_dispatch`
    counts only the rest into its queue)."""
    return DispatchDecision(instance_id, cached_tokens=_tokens_of(matched.get(instance_id, 0), request))


def choose_longest_prefix(
    loads: Sequence[LoadReport], request: DispatchRequest, config: PolicyConfig, context: PrefixContext
) -> DispatchDecision:
    live = dispatchable(loads, request)
    if isinstance(live, DispatchDecision):
        return live
    matched = matched_blocks(request, context.index)
    scored = [(cached_tokens(l, request, matched), dispatch_score(l, config.headroom_blocks), l.instance_id)
              for l in live]
    best = max((hit, score) for hit, score, _ in scored)
    tied = [iid for hit, score, iid in scored if hit == best[0] and score >= best[1] - config.tie_epsilon]
    return cached_decision(pick_tied(tied, request), request, matched)


def kv_cost(load: LoadReport, request: DispatchRequest, context: PrefixContext,
            matched: Mapping[str, int] | None = None) -> float:
    """Dynamo's cost in blocks: weight × (queued prefill + uncached request blocks) + decode blocks."""
    if matched is None:
        matched = matched_blocks(request, context.index)
    uncached = request.num_prompt_tokens - cached_tokens(load, request, matched)
    prefill_blocks = load.waiting_demand_blocks + blocks_for_tokens(uncached, load.block_size)
    decode_blocks = sum(level.running_blocks for level in load.by_priority)
    return context.kv_cost_overlap_weight * prefill_blocks + decode_blocks


def choose_min_kv_cost(
    loads: Sequence[LoadReport], request: DispatchRequest, config: PolicyConfig, context: PrefixContext
) -> DispatchDecision:
    live = dispatchable(loads, request)
    if isinstance(live, DispatchDecision):
        return live
    matched = matched_blocks(request, context.index)
    scored = [(kv_cost(l, request, context, matched), l.instance_id) for l in live]
    best = min(cost for cost, _ in scored)
    return cached_decision(pick_tied([iid for cost, iid in scored if cost <= best + config.tie_epsilon], request),
                           request, matched)


def _free_after_queue(load: LoadReport) -> int:
    """Blocks left once the queued prompts and admitted prefills have claimed theirs."""
    claimed = load.waiting_demand_blocks + load.committed_blocks + load.reserved_blocks
    return load.num_blocks_free - claimed
