"""Dispatch: send each request to the instance with the highest freeness.

Freeness for dispatch counts the whole waiting queue (QueueDemand.ALL); with only the head of the
line counted, a burst queued behind it stays invisible and keeps attracting requests.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from shared.messages import DispatchRequest, LoadReport, PriorityLoad, Refusal
from shared.policy.config import PolicyConfig
from shared.policy.freeness import QueueDemand, freeness, total_virtual_usage

# Rejection messages; the typed `Refusal` beside each is what the gateway maps to HTTP statuses.
REJECT_TOO_LONG = "prompt is longer than any instance's max_model_len"
REJECT_NO_INSTANCE = "no instance is available"
REJECT_OVERLOADED = "all instances are overloaded"


@dataclass(frozen=True)
class DispatchDecision:
    instance_id: str | None
    rejected: str | None = None
    reason: Refusal | None = None
    # Prompt tokens the chosen instance's prefix cache holds for the request, by the prefix index
    # the decision read (0: none, or a policy blind to the cache): its queue grows by the rest.
    cached_tokens: int = 0


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def fits_model(load: LoadReport, request: DispatchRequest) -> bool:
    return load.max_model_len <= 0 or request.num_prompt_tokens < load.max_model_len


def dispatchable(loads: Sequence[LoadReport], request: DispatchRequest) -> list[LoadReport] | DispatchDecision:
    """Instances that may take the request (live ones before draining ones), or the rejection."""
    candidates = [l for l in loads if l.instance_id not in request.exclude and fits_model(l, request)]
    if not candidates:
        if loads and not any(fits_model(l, request) for l in loads):
            return DispatchDecision(None, REJECT_TOO_LONG, Refusal.TOO_LONG)
        return DispatchDecision(None, REJECT_NO_INSTANCE, Refusal.NO_INSTANCE)
    return [l for l in candidates if not l.draining] or candidates


def pick_tied(instance_ids: Sequence[str], request: DispatchRequest) -> str:
    """Tie-break over instances in sorted order by a hash of the request id: deterministic for a
    request, uniform across requests (never the comparator that starves one instance)."""
    tied = sorted(instance_ids)
    return tied[zlib.crc32(request.request_id.encode()) % len(tied)]


def dispatch_score(load: LoadReport, headroom_blocks: Mapping[int, int]) -> float:
    """Dispatch freeness: the room left after the whole queue's demand, per request the instance
    holds (running and queued, as the public Llumnix code counts it); below zero, the deficit in
    blocks itself. Two departures from `freeness(load, ..., QueueDemand.ALL)`, both measured in
    the simulator near saturation:

    - per running request only, an instance busy with one long prompt looks nearly empty and
      every request of a burst lands behind that prefill (P99 TTFT +20 % against least-loaded
      dispatch on long-prompt traces); counting queued requests, each dispatch lowers it;
    - a deficit divided by the batch ranks overloaded instances backwards (a large batch with a
      large deficit looks better than a small one with a small deficit: P99 decode up to +50 %).
      Instances with room always rank above those without."""
    usage = total_virtual_usage(load, headroom_blocks, QueueDemand.ALL)
    if math.isinf(usage):
        return -math.inf
    room = load.num_blocks_total - usage
    return room / max(load.num_running + load.num_waiting, 1) if room >= 0 else room


def choose_instance(
    loads: Sequence[LoadReport], request: DispatchRequest, config: PolicyConfig
) -> DispatchDecision:
    """The instance with the highest dispatch score; rejects (Mooncake-style early rejection)
    only when configured and even the winner's freeness is below the threshold."""
    live = dispatchable(loads, request)
    if isinstance(live, DispatchDecision):
        return live
    scored = [(dispatch_score(l, config.headroom_blocks), l) for l in live]
    best_score, best = max(scored, key=lambda item: item[0])
    if config.reject_below_freeness is not None:
        if freeness(best, config.headroom_blocks, QueueDemand.ALL) < config.reject_below_freeness:
            return DispatchDecision(None, REJECT_OVERLOADED, Refusal.OVERLOADED)
    return DispatchDecision(pick_tied([l.instance_id for s, l in scored if s >= best_score - config.tie_epsilon], request))


def account_dispatch(load: LoadReport, request: DispatchRequest, cached_tokens: int = 0) -> LoadReport:
    """The load an instance will have once the request arrives, so that the requests dispatched
    between two reports do not all land on the instance that looked freest at the last one.
    `cached_tokens`: of its prompt, held in the instance's prefix cache (the decision's)."""
    return account_prompt(load, request.num_prompt_tokens, request.priority, cached_tokens)


def account_prompt(load: LoadReport, num_prompt_tokens: int, priority: int, cached_tokens: int = 0) -> LoadReport:
    """`account_dispatch` of a request known by its prompt's length and its priority. Its demand
    counts every block of the prompt (a cached one is claimed too); where the instance reports
    its waiting prefill in tokens, that grows by the uncached ones only (at least the last)."""
    demand = blocks_for_tokens(num_prompt_tokens + 1, load.block_size)
    prefill = load.waiting_prefill_tokens
    if prefill is not None:
        prefill += num_prompt_tokens - min(cached_tokens, max(num_prompt_tokens - 1, 0))
    by_priority = list(load.by_priority)
    for i, level in enumerate(by_priority):
        if level.priority == priority:
            by_priority[i] = msgspec.structs.replace(
                level,
                num_waiting=level.num_waiting + 1,
                waiting_demand_blocks=level.waiting_demand_blocks + demand,
            )
            break
    else:
        by_priority.append(PriorityLoad(priority=priority, num_waiting=1, waiting_demand_blocks=demand))
    return msgspec.structs.replace(
        load,
        num_waiting=load.num_waiting + 1,
        waiting_demand_blocks=load.waiting_demand_blocks + demand,
        waiting_prefill_tokens=prefill,
        head_demand_blocks=load.head_demand_blocks if load.num_waiting else demand,
        by_priority=by_priority,
    )
