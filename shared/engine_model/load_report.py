"""An engine's load report, built one way for the llumlets and the simulator.

`build_load_report` takes the request aggregates; a llumlet gets them from its engine's request
views (`aggregate_views`, O(requests)), the simulator from the counts its scheduler keeps up to
date as requests move (`RequestCounts` via `SimScheduler.load`, O(priority levels)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shared.engine_model.block_manager import blocks_for_tokens
from shared.engine_model.views import RequestPhase, RequestView
from shared.messages import MAX_RUNNING_OUTPUTS, DrainSource, InstanceRole, LoadReport, PriorityLoad
from shared.policy.freeness import QueueDemand, freeness


@dataclass(slots=True)  # (not frozen: a frozen dataclass costs 5x as much to build, per report)
class RequestAggregates:
    """What a load report says about an instance's requests."""

    num_running: int  # suspended ones (out of the batch for a migration's last stage) included
    num_waiting: int
    head_demand_blocks: int  # of the head of the waiting queue
    waiting_demand_blocks: int
    by_priority: list[PriorityLoad]  # ascending priority
    # Output tokens so far of each running request, up to MAX_RUNNING_OUTPUTS (live admission's
    # `predicted` policy; the simulator's reads its engines directly and leaves it empty).
    running_output_tokens: list[int] = field(default_factory=list)


def aggregate_views(views: Sequence[RequestView]) -> RequestAggregates:
    """`views` lists waiting requests first, in scheduling order: the first is the head of line."""
    levels: dict[int, PriorityLoad] = {}
    num_waiting = waiting_demand = 0
    head_demand = None
    outputs: list[int] = []
    for view in views:
        level = levels.get(view.priority)
        if level is None:
            level = levels[view.priority] = PriorityLoad(priority=view.priority)
        if view.phase is RequestPhase.RUNNING:
            level.num_running += 1
            level.running_blocks += view.physical_blocks
            if len(outputs) < MAX_RUNNING_OUTPUTS:
                outputs.append(view.num_output_tokens)
        else:
            level.num_waiting += 1
            level.waiting_demand_blocks += view.demand_blocks
            num_waiting += 1
            waiting_demand += view.demand_blocks
            if head_demand is None:
                head_demand = view.demand_blocks
    by_priority = sorted(levels.values(), key=lambda level: level.priority)
    return RequestAggregates(len(views) - num_waiting, num_waiting, head_demand or 0, waiting_demand, by_priority,
                             outputs)


class _Queued(Protocol):
    priority: int
    num_tokens: int


class RequestCounts:
    """Live and waiting requests per priority, and the waiting ones' demand, kept up to date by a
    scheduler as its requests arrive, queue, run and end."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.live: dict[int, int] = {}  # priority -> live requests (waiting, running or suspended)
        self.waiting_levels: dict[int, list[int]] = {}  # priority -> [count, demand blocks]
        self.waiting_demand_blocks = 0

    def demand_blocks(self, request: _Queued) -> int:
        """Blocks a queued request needs to be (re)scheduled: its whole sequence plus the next token."""
        return blocks_for_tokens(request.num_tokens + 1, self.block_size)

    def count_live(self, request: _Queued, sign: int) -> None:
        count = self.live.get(request.priority, 0) + sign
        if count:
            self.live[request.priority] = count
        else:
            del self.live[request.priority]

    def count_waiting(self, request: _Queued, sign: int) -> None:
        demand = sign * self.demand_blocks(request)
        self.waiting_demand_blocks += demand
        level = self.waiting_levels.get(request.priority)
        if level is None:
            level = self.waiting_levels[request.priority] = [0, 0]
        level[0] += sign
        level[1] += demand

    def aggregates(self, num_running: int, num_waiting: int, head: _Queued | None,
                   running_blocks: Mapping[int, int]) -> RequestAggregates:
        """In O(priority levels); `running_blocks`: blocks held per priority."""
        waiting_levels, live = self.waiting_levels, self.live
        by_priority = []
        for priority in sorted(live) if len(live) > 1 else live:
            level_waiting, demand = waiting_levels.get(priority) or (0, 0)
            # PriorityLoad(priority, num_running, running_blocks, num_waiting, waiting_demand_blocks)
            by_priority.append(PriorityLoad(
                priority, live[priority] - level_waiting, running_blocks.get(priority, 0), level_waiting, demand
            ))
        head_demand = self.demand_blocks(head) if head is not None else 0
        return RequestAggregates(num_running, num_waiting, head_demand, self.waiting_demand_blocks, by_priority)


def build_load_report(
    *,
    instance_id: str,
    seq: int,
    sent_at: float,
    requests: RequestAggregates,
    num_blocks_total: int,
    num_blocks_free: int,
    block_size: int,
    num_preemptions_total: int,
    headroom_blocks: Mapping[int, int] | None,
    draining: bool = False,
    drained_by: DrainSource | None = None,
    reserved_blocks: int = 0,
    committed_blocks: int = 0,
    waiting_prefill_tokens: int | None = None,
    num_migrating: int = 0,
    num_migrating_in: int = 0,
    max_migrations_in: int = 0,
    kv_address: str = "",
    max_model_len: int = 0,
    model: str = "",
    engine: str = "",
    role: InstanceRole = InstanceRole.MIXED,
    num_finished_total: int = 0,
    finished_output_tokens_total: int = 0,
    finished_output_histogram: Sequence[int] = (),
    num_accepted_total: int = 0,
    num_migrations_asked_total: int = 0,
    step_time_s: float = 0.0,
    step_decode_batch: float = 0.0,
    step_decode_context: float = 0.0,
    migration_candidate_hashes: Sequence[int] = (),
) -> LoadReport:
    """`headroom_blocks`: the execution-priority headroom the report's own freeness fields (for
    dashboards) are computed with; None leaves them 0 (the simulator: its policies compute
    freeness from the report themselves, and two freeness per report per instance add up)."""
    report = LoadReport(
        instance_id=instance_id,
        seq=seq,
        sent_at=sent_at,
        num_blocks_total=num_blocks_total,
        num_blocks_free=num_blocks_free,
        block_size=block_size,
        num_running=requests.num_running,
        num_waiting=requests.num_waiting,
        head_demand_blocks=requests.head_demand_blocks,
        waiting_demand_blocks=requests.waiting_demand_blocks,
        num_preemptions_total=num_preemptions_total,
        by_priority=requests.by_priority,
        num_migrating=num_migrating,
        num_migrating_in=num_migrating_in,
        max_migrations_in=max_migrations_in,
        reserved_blocks=reserved_blocks,
        committed_blocks=committed_blocks,
        waiting_prefill_tokens=waiting_prefill_tokens,
        draining=draining,
        drained_by=drained_by if draining else None,
        kv_address=kv_address,
        max_model_len=max_model_len,
        model=model,
        engine=engine,
        role=role,
        running_output_tokens=requests.running_output_tokens,
        num_finished_total=num_finished_total,
        finished_output_tokens_total=finished_output_tokens_total,
        finished_output_histogram=list(finished_output_histogram),
        num_accepted_total=num_accepted_total,
        num_migrations_asked_total=num_migrations_asked_total,
        step_time_s=step_time_s,
        step_decode_batch=step_decode_batch,
        step_decode_context=step_decode_context,
        migration_candidate_hashes=list(migration_candidate_hashes),
    )
    if headroom_blocks is not None:  # (None: nobody reads them; the policies compute their own)
        report.freeness = freeness(report, headroom_blocks, QueueDemand.HEAD)
        report.dispatch_freeness = freeness(report, headroom_blocks, QueueDemand.ALL)
    return report
