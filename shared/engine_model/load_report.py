"""Turn an engine's live requests into a load report (pure: also used by the simulator)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shared.engine_model.views import RequestPhase, RequestView
from shared.messages import LoadReport, PriorityLoad
from shared.policy.freeness import QueueDemand, freeness


def aggregate_by_priority(views: Sequence[RequestView]) -> list[PriorityLoad]:
    levels: dict[int, PriorityLoad] = {}
    for view in views:
        level = levels.get(view.priority)
        if level is None:
            level = levels[view.priority] = PriorityLoad(priority=view.priority)
        if view.phase is RequestPhase.RUNNING:
            level.num_running += 1
            level.running_blocks += view.physical_blocks
        else:
            level.num_waiting += 1
            level.waiting_demand_blocks += view.demand_blocks
    return sorted(levels.values(), key=lambda level: level.priority)


def build_load_report(
    *,
    instance_id: str,
    seq: int,
    sent_at: float,
    views: Sequence[RequestView],
    num_blocks_total: int,
    num_blocks_free: int,
    block_size: int,
    num_preemptions_total: int,
    headroom_blocks: Mapping[int, int],
    draining: bool = False,
    reserved_blocks: int = 0,
    num_migrating: int = 0,
    kv_address: str = "",
    max_model_len: int = 0,
    model: str = "",
    engine: str = "",
) -> LoadReport:
    """`views` lists waiting requests first, in scheduling order: the first is the head of line."""
    waiting = [v for v in views if v.phase is RequestPhase.WAITING]
    report = LoadReport(
        instance_id=instance_id,
        seq=seq,
        sent_at=sent_at,
        num_blocks_total=num_blocks_total,
        num_blocks_free=num_blocks_free,
        block_size=block_size,
        num_running=len(views) - len(waiting),
        num_waiting=len(waiting),
        head_demand_blocks=waiting[0].demand_blocks if waiting else 0,
        waiting_demand_blocks=sum(v.demand_blocks for v in waiting),
        num_preemptions_total=num_preemptions_total,
        by_priority=aggregate_by_priority(views),
        num_migrating=num_migrating,
        reserved_blocks=reserved_blocks,
        draining=draining,
        kv_address=kv_address,
        max_model_len=max_model_len,
        model=model,
        engine=engine,
    )
    report.freeness = freeness(report, headroom_blocks, QueueDemand.HEAD)
    report.dispatch_freeness = freeness(report, headroom_blocks, QueueDemand.ALL)
    return report

