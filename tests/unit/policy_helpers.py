"""Builders of load reports for policy tests."""

from __future__ import annotations

from shared.messages import LoadReport, PriorityLoad


def make_load(
    instance_id: str = "i0",
    *,
    total: int = 100,
    running: dict[int, tuple[int, int]] | None = None,  # priority -> (num_running, blocks)
    waiting: list[int] | None = None,  # demand blocks of queued requests, head first
    draining: bool = False,
    block_size: int = 16,
    max_model_len: int = 4096,
    reserved: int = 0,
) -> LoadReport:
    running = running or {}
    waiting = waiting or []
    levels = [PriorityLoad(priority=p, num_running=n, running_blocks=b) for p, (n, b) in running.items()]
    if waiting:
        levels.append(PriorityLoad(priority=0, num_waiting=len(waiting), waiting_demand_blocks=sum(waiting)))
    used = sum(b for _, b in running.values())
    return LoadReport(
        instance_id=instance_id,
        seq=1,
        sent_at=0.0,
        num_blocks_total=total,
        num_blocks_free=total - used - reserved,
        block_size=block_size,
        num_running=sum(n for n, _ in running.values()),
        num_waiting=len(waiting),
        head_demand_blocks=waiting[0] if waiting else 0,
        waiting_demand_blocks=sum(waiting),
        num_preemptions_total=0,
        by_priority=levels,
        draining=draining,
        max_model_len=max_model_len,
        reserved_blocks=reserved,
    )
