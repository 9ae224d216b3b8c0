"""Virtual usage and freeness (Llumnix Algorithm 1), computed from an instance's load report.

Memory is counted in KV blocks. A load report carries per-priority aggregates, which is all
Algorithm 1 needs: the sum over running requests of (physical blocks + headroom[p] / n[p]) is
the physical total plus headroom[p] once for every priority level that has a running request.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Protocol

from shared.messages import LoadReport


class QueueDemand(enum.Enum):
    HEAD = "head"  # Algorithm 1: only the head-of-line request (drives de-fragmentation)
    ALL = "all"  # every queued request (dispatch: a burst behind the head stays visible)


class RequestView(Protocol):
    priority: int
    physical_blocks: int
    demand_blocks: int


def headroom_per_request(priority: int, num_requests_at_priority: int, headroom_blocks: Mapping[int, int]) -> float:
    """GetHeadroom: the level's headroom split among its requests on the instance."""
    total = headroom_blocks.get(priority, 0)
    return total / num_requests_at_priority if num_requests_at_priority > 0 else 0.0


def request_virtual_usage(
    *,
    queuing: bool,
    is_head: bool,
    demand_blocks: int,
    physical_blocks: int,
    priority: int,
    num_requests_at_priority: int,
    headroom_blocks: Mapping[int, int],
) -> float:
    """CalcVirtualUsage for one request, exactly as Algorithm 1 states it (used by the tests
    and as the reference the aggregate form below must agree with)."""
    if queuing:
        return float(demand_blocks) if is_head else 0.0
    return physical_blocks + headroom_per_request(priority, num_requests_at_priority, headroom_blocks)


def total_virtual_usage(load: LoadReport, headroom_blocks: Mapping[int, int], queue: QueueDemand) -> float:
    if load.draining:
        return math.inf  # the fake request of a terminating instance
    running = sum(p.running_blocks for p in load.by_priority)
    headroom = sum(headroom_blocks.get(p.priority, 0) for p in load.by_priority if p.num_running > 0)
    queued = load.head_demand_blocks if queue is QueueDemand.HEAD else load.waiting_demand_blocks
    # Blocks reserved for incoming migrations, and those admitted prompts still have to claim
    # chunk by chunk, are spoken for, like running requests' blocks.
    return running + headroom + queued + load.reserved_blocks + load.committed_blocks


def freeness(load: LoadReport, headroom_blocks: Mapping[int, int], queue: QueueDemand = QueueDemand.HEAD) -> float:
    """F = (M - sum V) / B: how many more blocks each running request can still grow by.
    Negative when virtual usage exceeds capacity (queued demand, headroom); -inf when draining."""
    usage = total_virtual_usage(load, headroom_blocks, queue)
    if math.isinf(usage):
        return -math.inf
    batch = max(load.num_running, 1)
    return (load.num_blocks_total - usage) / batch
