"""A migration in the simulator as data: its state, the request as the destination adopts it,
and what a run counts (`Migrator` in `migration.py` drives them)."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from loadgen.simulator.instance import SimInstance
from shared.engine_model.request import RequestStatus, SimRequest
from shared.policy.migration import is_migratable


class MigrationStatus(enum.Enum):
    COPYING = "copying"  # a stage in flight, request still decoding on the source
    STOPPED = "stopped"  # last stage: request suspended, downtime running
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(eq=False)
class Migration:
    migration_id: str
    request_id: str
    src: SimInstance
    dst: SimInstance
    started_at: float
    status: MigrationStatus = MigrationStatus.COPYING
    stage: int = 0  # stages started
    blocks_sent: int = 0  # request blocks [0, blocks_sent) are on the destination
    lease_blocks: int = 0  # blocks reserved on the destination
    stage_blocks: int = 0  # blocks the stage in flight copies
    cached_blocks: int = 0  # leading blocks the destination's cache held: pinned there, never copied
    stages: list[tuple[int, bool]] = field(default_factory=list)  # (blocks, last) per stage
    suspended_at: float | None = None
    commit_due_at: float | None = None  # the last stage ends then, and the request commits
    handoff: bool = False  # a P/D hand-off at the first token, not a load-balancing move
    refused_by_destination: bool = False  # aborted: the destination refused blocks (else the source gave up)

    @property
    def lease_id(self) -> str:
        return self.migration_id


@dataclass
class MigrationStats:
    started: int = 0
    committed: int = 0
    aborted: Counter[str] = field(default_factory=Counter)
    downtime_s: list[float] = field(default_factory=list)
    duration_s: list[float] = field(default_factory=list)
    copied_blocks: int = 0
    cached_blocks: int = 0  # blocks not copied: the destination's prefix cache held them
    holds: int = 0  # steps a destination held for a commit (paced ones included)
    paced_holds: int = 0  # of them, paced for a commit steps ahead
    held_s: float = 0.0  # and how long in all (as expected at the hold)
    held_request_s: float = 0.0  # the price: each hold times the requests it held back
    stall_s: list[float] = field(default_factory=list)  # a moved request's last token there to its first here
    rounds: int = 0
    pairs: int = 0

    def to_json(self) -> dict:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {
            "started": self.started,
            "committed": self.committed,
            "aborted": dict(self.aborted),
            "mean_downtime_ms": round(mean(self.downtime_s) * 1000, 2),
            "max_downtime_ms": round(max(self.downtime_s, default=0.0) * 1000, 2),
            "mean_duration_ms": round(mean(self.duration_s) * 1000, 2),
            "copied_blocks": self.copied_blocks,
            "cached_blocks": self.cached_blocks,
            "mean_stall_ms": round(mean(self.stall_s) * 1000, 2),
            "max_stall_ms": round(max(self.stall_s, default=0.0) * 1000, 2),
            "holds": self.holds,
            "mean_hold_ms": round(self.held_s / self.holds * 1000, 2) if self.holds else 0.0,
            "paced_holds": self.paced_holds,
            "rounds": self.rounds,
            "pairs": self.pairs,
        }


def is_decoding(request: SimRequest) -> bool:
    """Running and migratable by the shared rule (`is_migratable`: decoding, never in prefill,
    not recovering from a preemption): it has KV to move and nothing half-computed."""
    return request.status is RequestStatus.RUNNING and is_migratable(
        num_output_tokens=request.num_output_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_tokens=request.num_tokens,
        recovering=request.preempted_at is not None,
    )


def clone_for_destination(request: SimRequest) -> SimRequest:
    """The request as the destination adopts it: progress and metrics carried over (what a
    MigrationCommit carries, plus the timestamps the simulator measures)."""
    clone = SimRequest(
        request.request_id,
        request.prompt_len,
        request.max_tokens,
        target_output_len=request.target_output_len,
        priority=request.priority,
        arrival_time=request.arrival_time,
        block_hashes=request.block_hashes,  # the destination may cache the prompt blocks it adopts
    )
    clone.num_output_tokens = request.num_output_tokens
    clone.num_computed_tokens = request.num_computed_tokens
    clone.num_preemptions = request.num_preemptions
    clone.num_cached_tokens = request.num_cached_tokens
    clone.first_scheduled_time = request.first_scheduled_time
    clone.first_token_time = request.first_token_time
    clone.last_token_time = request.last_token_time
    clone.preemption_loss_s = request.preemption_loss_s
    clone.num_recomputed_tokens = request.num_recomputed_tokens
    return clone
