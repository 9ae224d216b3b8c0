"""The simulated engine seen through `MigratableEngine`: its own migration verbs, plus the three
generic views (KV regions, candidates, snapshots) the coordinator asks for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.llumlet.engines.sim.request import RequestStatus
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

    def add_migrated(self, commit: MigrationCommit, lease_id: str) -> None:
        self.engine.add_migrated(commit, lease_id=lease_id)
