"""Dispatch: send each request to the instance with the highest freeness.

Freeness for dispatch counts the whole waiting queue (QueueDemand.ALL); with only the head of the
line counted, a burst queued behind it stays invisible and keeps attracting requests.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from shared.messages import DispatchRequest, LoadReport, PriorityLoad
from shared.policy.config import PolicyConfig
from shared.policy.freeness import QueueDemand, freeness


@dataclass(frozen=True)
class DispatchDecision:
    instance_id: str | None
    rejected: str | None = None


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def fits_model(load: LoadReport, request: DispatchRequest) -> bool:
    return load.max_model_len <= 0 or request.num_prompt_tokens < load.max_model_len


def choose_instance(
    loads: Sequence[LoadReport], request: DispatchRequest, config: PolicyConfig
) -> DispatchDecision:
    """Highest dispatch freeness wins; ties are broken by a hash of the request id over the tied
    instances in sorted order: deterministic for a request, uniform across requests."""
    candidates = [l for l in loads if l.instance_id not in request.exclude and fits_model(l, request)]
    if not candidates:
        if loads and not any(fits_model(l, request) for l in loads):
            return DispatchDecision(None, rejected="prompt is longer than any instance's max_model_len")
        return DispatchDecision(None, rejected="no instance is available")
    live = [l for l in candidates if not l.draining] or candidates
    scored = [(freeness(l, config.headroom_blocks, QueueDemand.ALL), l.instance_id) for l in live]
    best = max(score for score, _ in scored)
    if config.reject_below_freeness is not None and best < config.reject_below_freeness:
        return DispatchDecision(None, rejected="all instances are overloaded")
    tied = sorted(iid for score, iid in scored if score >= best - config.tie_epsilon)
    pick = zlib.crc32(request.request_id.encode()) % len(tied)
    return DispatchDecision(tied[pick])


def account_dispatch(load: LoadReport, request: DispatchRequest) -> LoadReport:
    """The load an instance will have once the request arrives, so that the requests dispatched
    between two reports do not all land on the instance that looked freest at the last one."""
    demand = blocks_for_tokens(request.num_prompt_tokens + 1, load.block_size)
    by_priority = list(load.by_priority)
    for i, level in enumerate(by_priority):
        if level.priority == request.priority:
            by_priority[i] = msgspec.structs.replace(
                level,
                num_waiting=level.num_waiting + 1,
                waiting_demand_blocks=level.waiting_demand_blocks + demand,
            )
            break
    else:
        by_priority.append(PriorityLoad(priority=request.priority, num_waiting=1, waiting_demand_blocks=demand))
    return msgspec.structs.replace(
        load,
        num_waiting=load.num_waiting + 1,
        waiting_demand_blocks=load.waiting_demand_blocks + demand,
        head_demand_blocks=load.head_demand_blocks if load.num_waiting else demand,
        by_priority=by_priority,
    )
