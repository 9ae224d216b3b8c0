"""Consistency checks of the local scheduler's state (tests and the simulator's debug runs call
them between steps; nothing on the hot path does)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from shared.engine_model.block_manager import BlockManager
from shared.engine_model.load_report import RequestCounts
from shared.engine_model.request import RequestStatus, SimRequest


class SchedulerState(Protocol):
    """The state the checks read (`SimScheduler`'s; no import of it: no cycle)."""

    block_manager: BlockManager
    block_size: int
    waiting: Iterable[SimRequest]
    running: list[SimRequest]
    suspended: dict[str, SimRequest]
    requests: dict[str, SimRequest]
    counts: RequestCounts


def check_scheduler_invariants(scheduler: SchedulerState) -> None:
    """Queues, block tables and the per-priority counts agree with each other."""
    bm = scheduler.block_manager
    bm.check_invariants()
    for r in scheduler.running:
        assert r.status is RequestStatus.RUNNING, r
        assert bm.num_blocks_of(r.request_id) * scheduler.block_size >= r.num_computed_tokens
    for r in scheduler.suspended.values():
        assert r.status == RequestStatus.SUSPENDED and bm.has_owner(r.request_id)
    waiting = list(scheduler.waiting)
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens == 0
        assert not bm.has_owner(r.request_id)
    assert len(scheduler.requests) == len(waiting) + len(scheduler.running) + len(scheduler.suspended)
    counts = scheduler.counts
    assert counts.waiting_demand_blocks == sum(counts.demand_blocks(r) for r in waiting)
    assert sum(level[0] for level in counts.waiting_levels.values()) == len(waiting)
    live: dict[int, int] = {}
    for r in scheduler.requests.values():
        live[r.priority] = live.get(r.priority, 0) + 1
    assert live == counts.live, (live, counts.live)
    owners = {r.request_id for r in scheduler.running} | set(scheduler.suspended)
    assert bm.num_used == len({b for o in owners for b in bm.blocks_of(o)} | bm.pinned_blocks())
