"""The source's record of one outgoing migration: its stages, timings and how it ended (the
stage driver in `source_stages.py` drives it; stats, benchmarks and tests read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.llumlet.migration.protocol import MigrationLifecycle, MigrationStatus


@dataclass
class StageRecord:
    stage: int
    num_blocks: int
    num_bytes: int
    seconds: float  # the copy: fusion, wire, scatter and acks
    prealloc_s: float  # the PRE-ALLOC round trip before it (last stage: only a top-up while suspended)
    final: bool
    num_tokens: int = 0  # token slots sent in token frames (a block not yet full), beside num_blocks


@dataclass(eq=False)
class OutgoingMigration(MigrationLifecycle):
    migration_id: str
    request_id: str
    dst: str
    num_preemptions: int  # at the start: a change means the request was preempted meanwhile
    status: MigrationStatus = MigrationStatus.RUNNING
    reason: str = ""
    stage: int = 0
    blocks_sent: int = 0  # request blocks [0, blocks_sent) are on the destination
    tokens_sent: int = 0  # request token positions [0, tokens_sent) are (≥ blocks_sent whole blocks)
    cached_blocks: int = 0  # leading blocks the destination's prefix cache held: never sent
    lease_blocks: int = 0  # blocks the destination has reserved for us
    stage_lease_start: int = 0  # lease blocks reserved before the current stage
    kv_address: str = ""
    stages: list[StageRecord] = field(default_factory=list)
    started_at: float = 0.0
    suspended_at: float | None = None
    suspend_s: float = 0.0  # the suspend call: waits for the engine step in flight, then aborts
    commit_s: float = 0.0  # the COMMIT round trip (in a frame: the last copy's, with the commit)
    commit_via: str = ""  # "frame", or "frame+nats" (the frame's ack was lost: asked over NATS)
    commit_sent: bool = False  # a COMMIT may have reached the destination: an abort asks it first
    commit_sent_at: float | None = None  # the last stage (with the COMMIT) started out
    committed_at: float | None = None  # the destination acknowledged the COMMIT
    release_s: float = 0.0  # freeing the request here afterwards (off the downtime)
    dst_hold_max_s: float = 0.0  # the destination holds a step this long for a noticed commit (0: no notice)
    noticed_at: float | None = None  # the CommitNotice went out
    notice_commit_in_s: float | None = None  # what it said
    ended_at: float | None = None

    @property
    def downtime_s(self) -> float | None:
        """Out of the batch: suspend → commit acknowledged (the request is queued into the
        destination's batch), as the source saw it."""
        if self.suspended_at is None or self.committed_at is None:
            return None
        return self.committed_at - self.suspended_at
