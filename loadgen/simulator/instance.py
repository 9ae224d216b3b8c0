"""One simulated instance: the simulated engine's own scheduler and latency model, a lifecycle,
and the load report a llumlet would publish."""

from __future__ import annotations

import collections
import enum
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine_model.latency import LatencyModel
from shared.engine_model.load_report import build_load_report
from shared.engine_model.scheduler import SimScheduler
from shared.engine_model.step import SchedulerOutput
from shared.messages import InstanceRole, LoadReport
from shared.policy.commit_hold import TYPICAL_STEP_WINDOW


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
    role: InstanceRole = InstanceRole.MIXED
    tells_prefill_tokens: bool = True  # False: its reports leave `waiting_prefill_tokens` untold
    stopped_at: float | None = None
    step: SchedulerOutput | None = None  # the step in flight, if any
    report: LoadReport | None = None  # the last report, plus dispatches accounted since
    report_at: float = -math.inf
    migrations_out: int = 0
    migrations_in: int = 0
    max_migrations_in: int = 0  # as its report tells (the llumlet's --migration-max-in; 0: not told)
    num_steps: int = 0
    busy_s: float = 0.0
    step_started_at: float = 0.0  # the step in flight's (or the latest one's) start
    step_ends_at: float = 0.0  # and its end
    # The latest steps' durations: their median is the typical step a commit hold is bounded by
    # (as the llumlet's `StepClock`).
    recent_steps_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=TYPICAL_STEP_WINDOW), repr=False)
    _seq: int = field(default=0, repr=False)
    # Told of every report built (the simulator's dispatch index keeps its ranking by it).
    on_report: Callable[[SimInstance], None] | None = field(default=None, repr=False)

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
                self.step_started_at, self.step_ends_at = now, now + duration
                return duration
            if not out.preempted:
                return None  # blocked on blocks (reserved for a migration, or the head is too big)
            # Everything that ran was preempted; the next schedule admits again (as vLLM v1).
        return None

    def end_step(self) -> SchedulerOutput:
        """The step in flight ended: it counts among the recent ones from now (as `StepClock`
        counts a step when it ends: a source's notice in its step goes by the steps before it)."""
        step = self.step
        assert step is not None, "a step ended that never started"
        self.step = None
        self.recent_steps_s.append(self.step_ends_at - self.step_started_at)
        return step

    @property
    def typical_step_s(self) -> float:
        return statistics.median(self.recent_steps_s) if self.recent_steps_s else 0.0

    def is_empty(self) -> bool:
        return (
            self.step is None
            and not self.scheduler.requests
            and self.migrations_in == 0
            and self.migrations_out == 0
            and self.scheduler.block_manager.num_reserved == 0
        )

    def build_report(self, now: float, max_model_len: int) -> LoadReport:
        """What the llumlet would publish now, by its own builder, from the scheduler's
        incrementally kept counts (O(priority levels)) instead of request views. Without the
        freeness a llumlet adds for dashboards: the policies compute it from the report."""
        scheduler = self.scheduler
        self._seq += 1
        blocks = scheduler.block_manager
        self.report = build_load_report(
            instance_id=self.instance_id,
            seq=self._seq,
            sent_at=now,
            requests=scheduler.load(),
            num_blocks_total=scheduler.config.num_blocks,
            num_blocks_free=blocks.num_free,
            block_size=scheduler.block_size,
            num_preemptions_total=scheduler.num_preemptions_total,
            headroom_blocks=None,
            draining=self.state is InstanceState.DRAINING,
            reserved_blocks=blocks.num_reserved,
            committed_blocks=scheduler.committed_blocks(),
            waiting_prefill_tokens=scheduler.waiting_prefill_tokens() if self.tells_prefill_tokens else None,
            num_migrating=self.migrations_in + self.migrations_out,
            num_migrating_in=self.migrations_in,
            max_migrations_in=self.max_migrations_in,
            max_model_len=max_model_len,
            engine="sim",
            role=self.role,
        )
        self.report_at = now
        if self.on_report is not None:
            self.on_report(self)
        return self.report
