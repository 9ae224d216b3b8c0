"""One simulated instance: the simulated engine's own scheduler and latency model, a lifecycle,
and the load report a llumlet would publish."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from services.llumlet.engines.sim.latency import LatencyModel
from services.llumlet.engines.sim.request import SimRequest
from services.llumlet.engines.sim.scheduler import SchedulerOutput, SimScheduler
from shared.messages import LoadReport, PriorityLoad
from shared.policy.config import NORMAL_PRIORITY


class InstanceState(enum.Enum):
    STARTING = "starting"  # launched, loading the model: billed, not yet serving
    LIVE = "live"
    DRAINING = "draining"  # terminating: the fake request drives everything off it
    STOPPED = "stopped"


@dataclass(eq=False)
class SimInstance:
    instance_id: str
    scheduler: SimScheduler
    latency: LatencyModel
    launched_at: float
    state: InstanceState = InstanceState.LIVE
    stopped_at: float | None = None
    step: SchedulerOutput | None = None  # the step in flight, if any
    report: LoadReport | None = None  # the last report, plus dispatches accounted since
    report_at: float = -math.inf
    migrations_out: int = 0
    migrations_in: int = 0
    num_steps: int = 0
    busy_s: float = 0.0
    # Live requests here whose priority is not normal: with them, a report without a queue
    # costs O(their number) instead of O(running).
    prioritized: set[str] = field(default_factory=set)
    _seq: int = field(default=0, repr=False)

    @property
    def serving(self) -> bool:
        return self.state is InstanceState.LIVE or self.state is InstanceState.DRAINING

    def start_step(self, now: float) -> float | None:
        """Schedule the next step if idle and there is work; returns its duration, or None when
        nothing can run (empty, or the head of the queue waits for blocks)."""
        if self.step is not None:
            return None  # (a starting or stopped instance holds no request, so it never steps)
        scheduler = self.scheduler
        while scheduler.running or scheduler.waiting:
            out = scheduler.schedule(now)
            if out.requests:
                duration = self.latency.step_time_of(out)
                self.step = out
                self.num_steps += 1
                self.busy_s += duration
                return duration
            if not out.preempted:
                return None  # blocked on blocks (reserved for a migration, or the head is too big)
            # Everything that ran was preempted; the next schedule admits again (as vLLM v1).
        return None

    def is_empty(self) -> bool:
        return (
            self.step is None
            and not self.scheduler.requests
            and self.migrations_in == 0
            and self.migrations_out == 0
            and self.scheduler.block_manager.num_reserved == 0
        )

    def joined(self, request: SimRequest) -> None:
        if request.priority != NORMAL_PRIORITY:
            self.prioritized.add(request.request_id)

    def left(self, request: SimRequest) -> None:
        self.prioritized.discard(request.request_id)

    def build_report(self, now: float, max_model_len: int) -> LoadReport:
        """What the llumlet would publish now: the aggregates `build_load_report` computes from
        request views. With a queue, from the scheduler's O(running) `load()`; without one (the
        common case below saturation), from block counts and the few prioritized requests."""
        scheduler = self.scheduler
        self._seq += 1
        if scheduler.waiting:
            load = scheduler.load()
            num_running, by_priority, num_waiting = load.num_running, load.by_priority, load.num_waiting
            head_demand, waiting_demand = load.head_demand_blocks, load.waiting_demand_blocks
        else:
            num_running = len(scheduler.running) + len(scheduler.suspended)
            by_priority = self._running_levels(num_running)
            num_waiting = head_demand = waiting_demand = 0
        blocks = scheduler.block_manager
        self.report = LoadReport(
            instance_id=self.instance_id,
            seq=self._seq,
            sent_at=now,
            num_blocks_total=scheduler.config.num_blocks,
            num_blocks_free=blocks.num_free,
            block_size=scheduler.block_size,
            num_running=num_running,
            num_waiting=num_waiting,
            head_demand_blocks=head_demand,
            waiting_demand_blocks=waiting_demand,
            num_preemptions_total=scheduler.num_preemptions_total,
            by_priority=by_priority,
            num_migrating=self.migrations_in + self.migrations_out,
            reserved_blocks=blocks.num_reserved,
            draining=self.state is InstanceState.DRAINING,
            max_model_len=max_model_len,
            engine="sim",
        )
        self.report_at = now
        return self.report

    def _running_levels(self, num_running: int) -> list[PriorityLoad]:
        """Per-priority running aggregates when nothing waits: every live request then holds
        blocks, and the normal level is the total minus the prioritized requests."""
        blocks = self.scheduler.block_manager
        levels: dict[int, PriorityLoad] = {}
        for request_id in self.prioritized:
            priority = self.scheduler.requests[request_id].priority
            level = levels.get(priority) or levels.setdefault(priority, PriorityLoad(priority))
            level.num_running += 1
            level.running_blocks += blocks.num_blocks_of(request_id)
        normal_running = num_running - len(self.prioritized)
        if normal_running:
            assert NORMAL_PRIORITY not in levels
            levels[NORMAL_PRIORITY] = PriorityLoad(
                NORMAL_PRIORITY,
                num_running=normal_running,
                running_blocks=blocks.num_used - sum(level.running_blocks for level in levels.values()),
            )
        return [levels[p] for p in sorted(levels)]
