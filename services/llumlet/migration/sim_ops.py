"""The simulated engine seen through `MigratableEngine`: its own migration verbs, plus the three
generic views (KV regions, candidates, snapshots) the coordinator asks for."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from shared.engine_model.request import RequestStatus
from services.llumlet.migration.ops import IntakeLoad
from services.llumlet.migration.ops import KVRegion, LivePhase, MigrationSnapshot
from shared.messages import MigrationCommit
from shared.policy.migration import MigrationCandidate

_PHASES = {
    RequestStatus.WAITING: LivePhase.QUEUED,
    RequestStatus.PREEMPTED: LivePhase.QUEUED,
    RequestStatus.RUNNING: LivePhase.RUNNING,
    RequestStatus.SUSPENDED: LivePhase.SUSPENDED,
}


class SimMigrationAdapter:
    """`MigratableEngine` over the simulated engine (its own verbs plus three generic views)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        pool = engine.kv_pool
        self._regions = () if pool is None else (KVRegion(pool.data, 0),)
        # The same verbs, delegated as they are.
        self.num_reserved_blocks = engine.num_reserved_blocks
        self.block_ids_of = engine.block_ids_of
        self.suspend = engine.suspend
        self.resume = engine.resume
        self.migration_commit = engine.migration_commit
        self.release_migrated = engine.release_migrated
        self.reserve_blocks = engine.reserve_blocks
        self.release_reservation = engine.release_reservation
        self._migrated_in_at: dict[str, float] = {}  # request id → when it was committed here

    def kv_regions(self) -> Sequence[KVRegion]:
        return self._regions

    def migration_candidates(self) -> list[MigrationCandidate]:
        return [
            MigrationCandidate(r.request_id, r.priority, r.num_tokens)
            for r in self.engine.scheduler.running
            if r.status is RequestStatus.RUNNING and r.num_output_tokens > 0
        ]

    def migration_snapshot(self, request_id: str) -> MigrationSnapshot | None:
        request = self.engine.get_request(request_id)
        if request is None or request.is_finished:
            return None
        blocks = self.engine.scheduler.block_manager.num_blocks_of(request_id)
        return MigrationSnapshot(_PHASES[request.status], request.num_computed_tokens, request.num_preemptions, blocks)

    def residence_s(self, request_id: str) -> float | None:
        """Since it arrived (its arrival time: the engine's clock, wall time in a llumlet, or the
        gateway's) or migrated in here; None if it is not here."""
        request = self.engine.get_request(request_id)
        if request is None or request.is_finished:
            return None
        since = max(request.arrival_time, self._migrated_in_at.get(request_id, 0.0))
        return time.time() - since

    def intake_load(self) -> IntakeLoad:
        scheduler = self.engine.scheduler
        return IntakeLoad(self.engine.num_free_blocks(), self.engine.num_blocks_total, len(scheduler.waiting))

    def add_migrated(self, commit: MigrationCommit, lease_id: str) -> None:
        self.engine.add_migrated(commit, lease_id=lease_id)
        # (forget the requests that left since: the table holds only live ones)
        self._migrated_in_at = {rid: t for rid, t in self._migrated_in_at.items() if self.engine.get_request(rid)}
        self._migrated_in_at[commit.request.request_id] = time.time()
