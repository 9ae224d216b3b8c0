"""Live migration: the status enum, the errors that end a migration, and every limit and
interval of the protocol, named in one place.

Message flow (source S, destination D; NATS request/reply unless noted):

    S → D  PRE-ALLOC(stage k, n blocks)        D reserves under a lease (renewed) or refuses; a
                                               repeat gets the same blocks, a larger n tops up
    S → D  KV frames over TCP (stage k)        D scatters into the lease's blocks, acks each frame
    ...    S re-checks the request after every await: finished/aborted/preempted → ABORT
    S      last stage (few blocks left, or the stage limit reached): PRE-ALLOC while the request
           still runs, then suspend, a top-up PRE-ALLOC only if it grew meanwhile, and copy the
           rest (incl. the partial block); the same order whichever way the last stage came
    S → D  NOTICE(commit in ≈ X s)             NATS publish, when the destination's grants say it
                                               holds (hold_max_s > 0): as the suspend is asked, a
                                               step early; D's next step waits for the commit
    S → D  COMMIT(request, output so far)      in the last stage's last KV frame (TCP): once the
                                               frame is written D adopts the lease's blocks,
                                               resumes the request and answers in the frame's ack
                                               (COMMITTED / refused, with the reason)
    S → D  COMMIT over NATS (fallback)         only when that ack never came (connection lost,
                                               timeout): idempotent, D answers from its record;
                                               unanswered, an ABORT decides (refused "already
                                               committed": it runs on D)
    S      release the request; D publishes from the next token index on

Either side failing ends the migration: a dead destination leaves the request running on the
source; a dead source lets the destination's lease expire (watchdog).
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass

from shared.messages import PreAllocReply
from shared.policy.commit_hold import DEFAULT_HOLD, DEFAULT_NOTICE_STEPS, CommitHoldRule
from shared.policy.migration import (
    DEFAULT_GUARD,
    DEFAULT_MAX_IN,
    DEFAULT_MAX_OUT,
    DEFAULT_STAGES,
    IDLE_POLL_S,
    REFUSED_BACKOFF_S,
    MigrationGuard,
    StageRule,
)


class MigrationStatus(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"  # committed: the request runs on the destination now
    ABORTED_SRC = "aborted_src"  # the source gave up: request finished/aborted/preempted, or stopping
    ABORTED_DST = "aborted_dst"  # the destination refused, vanished, timed out or got a bad frame

    @property
    def is_over(self) -> bool:
        return self is not MigrationStatus.RUNNING


class MigrationFailed(Exception):
    """Ends a migration; `status` says which side caused it."""

    status = MigrationStatus.ABORTED_DST


class SourceAborted(MigrationFailed):
    """The request is no longer migratable here (finished, aborted, preempted) or we are stopping."""

    status = MigrationStatus.ABORTED_SRC


class DestinationRefused(MigrationFailed):
    """The destination said no (no room, busy, draining, unknown migration, bad frame)."""


class DestinationGone(MigrationFailed):
    """Nobody answers on the destination's subjects, or its KV connection broke."""


class DestinationSlow(MigrationFailed):
    """The destination did not answer in time (it may still be alive)."""


class CommitOutcomeUnknown(MigrationFailed):
    """A KV frame carrying the COMMIT may have reached the destination, but its ack never came
    (connection lost, timeout): whether it committed is unknown. The source asks over NATS (the
    COMMIT is idempotent); never a reason to resume the request by itself."""


# An ABORT for a migration the destination already committed is refused with this error: the
# request runs there now (the source learns the outcome of an unanswered COMMIT this way).
ALREADY_COMMITTED = "already committed"


PreAllocGrant = PreAllocReply  # the destination's answer, with its KV receiver's address


@dataclass(frozen=True)
class MigrationLimits:
    """Every interval, timeout and size of the protocol (one place, units in the names)."""

    # Stages: the policy's `StageRule` (shared with the simulator; its defaults, its reasons).
    stage_limit: int = DEFAULT_STAGES.stage_limit
    last_stage_blocks: int = DEFAULT_STAGES.last_stage_blocks
    # Destination: a lease is renewed by every PRE-ALLOC and every received frame; a source
    # that vanishes lets it run out. The watchdog frees expired leases.
    lease_s: float = 5.0
    watchdog_interval_s: float = 0.25
    tombstone_s: float = 60.0  # remember ended migrations this long (late commits are refused)
    # Handshake over NATS: every request has its own timeout.
    prealloc_timeout_s: float = 1.0
    abort_timeout_s: float = 0.5
    commit_timeout_s: float = 2.0
    commit_attempts: int = 3  # NATS COMMITs (the fallback: the last frame's ack was lost)
    # An unanswered commit leaves the outcome unknown: keep asking (ABORT is decisive) this long
    # before failing the request with an error.
    in_doubt_deadline_s: float = 15.0
    # Data plane (TCP).
    connect_timeout_s: float = 2.0
    frame_bytes: int = 16 << 20  # stages are shipped in frames of at most this (one gathers while one is sent)
    # Source: send a block not yet full by its computed token slots (token frames), where the KV
    # layout allows it, so the last stage carries only the tokens computed since the stage before;
    # False: whole blocks only, as device memory moves here. Receivers take both either way.
    token_frames: bool = True
    max_frame_bytes: int = 256 << 20  # receiver: larger frames are refused (connection closed)
    # Cap on the data plane's rate (0: none), so migrations leave bandwidth to everything else;
    # frames then shrink to about `throttle_frame_s` worth of bytes, so the cap is smooth.
    bandwidth_bytes_per_s: float = 0.0
    throttle_frame_s: float = 0.05
    stage_timeout_base_s: float = 2.0
    stage_timeout_min_bytes_per_s: float = 50e6  # a stage may take base + bytes / this
    # The policy's anti-thrash `MigrationGuard` (shared with the scheduler and the simulator).
    # Source: a request is picked only after it has stayed this long here since it arrived or
    # migrated in (no ping-pong). Destination: the first PRE-ALLOC is refused while requests wait
    # here, or when taking the request would leave less than this fraction of the blocks free
    # (it would become a source).
    min_residence_s: float = DEFAULT_GUARD.min_residence_s
    min_return_s: float = DEFAULT_GUARD.min_return_s  # no going back soon to an instance it left
    dest_max_waiting: int = DEFAULT_GUARD.dest_max_waiting
    dest_min_free_fraction: float = DEFAULT_GUARD.dest_min_free_fraction_after
    # Source loop.
    max_out: int = DEFAULT_MAX_OUT
    max_in: int = DEFAULT_MAX_IN
    pair_ttl_s: float = 1.0  # an order not re-confirmed for this long lapses (scheduler gone)
    refused_backoff_s: float = REFUSED_BACKOFF_S  # after the destination refused, wait before trying it again
    idle_poll_s: float = IDLE_POLL_S  # with a pair but nothing to migrate, look again after this
    # Destination: hold the next engine step up to this long for a commit the source said is
    # imminent (`CommitNotice`), so the request joins that step instead of the one after (0: never
    # hold), and at most this share of the destination's typical step. The price: the other
    # requests here wait as long (`commit_hold.py`; why on by default: `shared.policy.commit_hold`).
    hold_max_s: float = DEFAULT_HOLD.hold_max_s
    hold_step_share: float = DEFAULT_HOLD.step_share
    # Source: the notice goes this many of its steps ahead (the destination paces its steps to
    # meet the commit; 1: a step ahead, hold or not).
    notice_steps: int = DEFAULT_NOTICE_STEPS

    def __post_init__(self) -> None:
        self.stage_rule(), self.guard()  # (they check their own fields)
        if self.max_out < 0 or self.max_in < 0:
            raise ValueError("max_out and max_in must be >= 0")
        CommitHoldRule(self.hold_max_s, self.hold_step_share)  # (it checks both)
        if self.notice_steps < 1:
            raise ValueError("notice_steps must be >= 1")
        if self.bandwidth_bytes_per_s < 0:
            raise ValueError("bandwidth_bytes_per_s must be >= 0 (0: no cap)")
        if self.frame_bytes <= 0 or self.frame_bytes > self.max_frame_bytes:
            raise ValueError("frame_bytes must be in (0, max_frame_bytes]")
        for name in ("lease_s", "watchdog_interval_s", "prealloc_timeout_s", "abort_timeout_s",
                     "commit_timeout_s", "connect_timeout_s", "pair_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def stage_timeout_s(self, num_bytes: int) -> float:
        rate = self.stage_timeout_min_bytes_per_s
        if self.bandwidth_bytes_per_s:
            rate = min(rate, self.bandwidth_bytes_per_s / 2)
        return self.stage_timeout_base_s + num_bytes / rate

    def guard(self) -> MigrationGuard:
        """The guard's rules with these limits (for `may_migrate_into`; the freeness gap is the
        scheduler's, which pairs)."""
        return MigrationGuard(dest_max_waiting=self.dest_max_waiting, min_residence_s=self.min_residence_s,
                              dest_min_free_fraction_after=self.dest_min_free_fraction,
                              min_return_s=self.min_return_s)

    def stage_rule(self) -> StageRule:
        return StageRule(stage_limit=self.stage_limit, last_stage_blocks=self.last_stage_blocks)

    def effective_frame_bytes(self) -> int:
        if not self.bandwidth_bytes_per_s:
            return self.frame_bytes
        return max(1, min(self.frame_bytes, int(self.bandwidth_bytes_per_s * self.throttle_frame_s)))


def new_migration_id() -> str:
    return uuid.uuid4().hex


def migration_id_bytes(migration_id: str) -> bytes:
    """The 16 bytes a KV frame carries; raises ValueError for an id we did not make."""
    return uuid.UUID(hex=migration_id).bytes


def migration_id_from_bytes(raw: bytes) -> str:
    return uuid.UUID(bytes=raw).hex


class MigrationLifecycle:
    """Status transitions shared by both sides of a migration; each asserts the legal start.
    The dataclasses using it declare `migration_id`, `status`, `reason` and `ended_at`."""

    def finish(self, now: float) -> None:
        assert self.status is MigrationStatus.RUNNING, (self.migration_id, self.status)
        self.status, self.ended_at = MigrationStatus.FINISHED, now

    def abort(self, status: MigrationStatus, reason: str, now: float) -> None:
        assert self.status is MigrationStatus.RUNNING, (self.migration_id, self.status)
        assert status in (MigrationStatus.ABORTED_SRC, MigrationStatus.ABORTED_DST), status
        self.status, self.reason, self.ended_at = status, reason, now
