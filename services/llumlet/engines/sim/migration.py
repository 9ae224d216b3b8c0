"""The simulated engine's migration verbs, as `MigratableEngine` (`migration/ops.py`).

Composed over the engine: `SimMigration` reaches it only through `SimEngineParts`, so what it
depends on is declared here. The verbs change the local scheduler at once (no engine thread to
wait for), but for `suspend`, which waits for the step in flight, as vLLM's engine thread does:
the request keeps that step's token, and no step's work is thrown away (a suspend in the middle
of a step would add up to a step to the client's stall).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from services.llumlet.migration.handover import log_first_step
from services.llumlet.migration.ops import IntakeLoad, KVRegion, LivePhase, MigrationSnapshot
from shared.engine_model.kv_pool import KVPool
from shared.engine_model.request import RequestStatus, SimRequest
from shared.engine_model.scheduler import SimScheduler
from shared.engine_model.views import EngineError
from shared.messages import GenerateRequest, MigrationCommit
from shared.policy.migration import MigrationCandidate, is_migratable

log = logging.getLogger(__name__)

_PHASES = {
    RequestStatus.WAITING: LivePhase.QUEUED,
    RequestStatus.PREEMPTED: LivePhase.QUEUED,
    RequestStatus.RUNNING: LivePhase.RUNNING,
    RequestStatus.SUSPENDED: LivePhase.SUSPENDED,
}


class SimEngineParts(Protocol):
    """What the migration verbs use of the simulated engine."""

    block_size: int
    num_blocks_total: int
    scheduler: SimScheduler
    kv_pool: KVPool | None

    def num_free_blocks(self) -> int: ...

    def now(self) -> float: ...

    def at_step_end(self, callback: Callable[[], None]) -> None:
        """Run `callback` after the step in flight, before the next schedules (now if none is)."""

    def input_of(self, request_id: str) -> GenerateRequest:
        """A live request as it came in."""

    def to_sim(self, request: GenerateRequest) -> SimRequest: ...

    def admit(self, request: GenerateRequest, sim: SimRequest, migrated_lease: str | None = None) -> None: ...

    def forget(self, request_id: str) -> None: ...


class SimMigration:
    """`MigratableEngine` for the simulated engine: one per engine (`SimEngine.migration_ops`)."""

    def __init__(self, engine: SimEngineParts) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        pool = engine.kv_pool
        # [blocks, slots, bytes of a token]: a view of the pool (the same fused bytes as its rows)
        self._regions = () if pool is None else (
            KVRegion(pool.data.reshape(pool.num_blocks, pool.block_size, -1), 0, 1),)
        self._migrated_in_at: dict[str, float] = {}  # request id → when it was committed here
        self._first_step_due: dict[str, float] = {}  # committed here, no token yet: its commit (monotonic)

    @property
    def _scheduler(self) -> SimScheduler:
        return self.engine.scheduler

    # -- both sides ----------------------------------------------------------------------------

    def kv_regions(self) -> Sequence[KVRegion]:
        return self._regions

    def num_reserved_blocks(self) -> int:
        return self._scheduler.block_manager.num_reserved

    # -- source --------------------------------------------------------------------------------

    def migration_candidates(self) -> list[MigrationCandidate]:
        return [
            MigrationCandidate(r.request_id, r.priority, r.num_tokens)
            for r in self._scheduler.running
            if r.status is RequestStatus.RUNNING and is_migratable(
                num_output_tokens=r.num_output_tokens, num_computed_tokens=r.num_computed_tokens,
                num_tokens=r.num_tokens, recovering=r.preempted_at is not None)
        ]

    def migration_snapshot(self, request_id: str) -> MigrationSnapshot | None:
        request = self._live(request_id)
        if request is None:
            return None
        blocks = self._scheduler.block_manager.num_blocks_of(request_id)
        return MigrationSnapshot(_PHASES[request.status], request.num_computed_tokens, request.num_preemptions, blocks,
                                 max_num_tokens=request.prompt_len + request.max_tokens)

    def block_ids_of(self, request_id: str) -> list[int]:
        return self._scheduler.block_ids_of(request_id)

    def prefix_block_hashes(self, request_id: str) -> Sequence[int]:
        request = self._live(request_id)
        return () if request is None else request.block_hashes

    def residence_s(self, request_id: str) -> float | None:
        """Since it arrived (its arrival time: the engine's clock, wall time in a llumlet, or the
        gateway's) or migrated in here; None if it is not here."""
        request = self._live(request_id)
        if request is None:
            return None
        since = max(request.arrival_time, self._migrated_in_at.get(request_id, 0.0))
        return time.time() - since

    async def suspend(self, request_id: str) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def at_boundary() -> None:
            if not done.done():  # (a cancelled wait suspends nothing)
                done.set_result(self._scheduler.suspend(request_id))

        self.engine.at_step_end(at_boundary)
        return await done

    async def resume(self, request_id: str) -> bool:
        return self._scheduler.resume(request_id)

    def migration_commit(self, request_id: str, migration_id: str) -> MigrationCommit:
        request = self._scheduler.get(request_id)
        if request is None or request.status is not RequestStatus.SUSPENDED:
            raise EngineError(f"request {request_id} is not suspended for migration")
        return MigrationCommit(
            migration_id=migration_id,
            request=self.engine.input_of(request_id),
            output_token_ids=list(request.output_token_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_preemptions=request.num_preemptions,
        )

    async def release_migrated(self, request_id: str) -> bool:
        released = self._scheduler.release_migrated(request_id, self.engine.now())
        if released:
            self.engine.forget(request_id)
        return released

    # -- destination ---------------------------------------------------------------------------

    def intake_load(self) -> IntakeLoad:
        return IntakeLoad(self.engine.num_free_blocks(), self.engine.num_blocks_total, len(self._scheduler.waiting),
                          self._scheduler.committed_blocks())

    async def pin_cached_prefix(self, lease_id: str, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        pinned = self._scheduler.pin_cached_prefix(lease_id, block_hashes, max_blocks)
        return self._scheduler.block_manager.reserved_blocks(lease_id)[:pinned]

    async def reserve_blocks(self, lease_id: str, num_blocks: int) -> list[int] | None:
        return self._scheduler.reserve(lease_id, num_blocks)

    def release_reservation(self, lease_id: str) -> int:
        return self._scheduler.release(lease_id)

    def add_migrated(self, commit: MigrationCommit, lease_id: str) -> None:
        """The request resumes here on the lease's blocks, its output continuing from the next
        token index."""
        request = self.engine.to_sim(commit.request)
        request.output_token_ids = list(commit.output_token_ids)
        request.num_output_tokens = len(commit.output_token_ids)
        request.num_computed_tokens = commit.num_computed_tokens
        request.num_preemptions = commit.num_preemptions
        self.engine.admit(commit.request, request, migrated_lease=lease_id)
        # (forget the requests that left since: the table holds only live ones)
        self._migrated_in_at = {rid: t for rid, t in self._migrated_in_at.items() if self._live(rid)}
        self._migrated_in_at[commit.request.request_id] = time.time()
        self._first_step_due[commit.request.request_id] = time.monotonic()

    def stepped(self, request_ids: list[str], step_started_at: float) -> None:
        """A step produced tokens for `request_ids`: log the handover of those migrated in whose
        first token it was (the destination's share of the client's stall)."""
        if not self._first_step_due:
            return
        ended = time.monotonic()
        for request_id in request_ids:
            committed = self._first_step_due.pop(request_id, None)
            if committed is not None:  # (the sim adds it to its scheduler at the commit itself)
                log_first_step(log, request_id, committed, committed, step_started_at, ended)

    def _live(self, request_id: str) -> SimRequest | None:
        request = self._scheduler.get(request_id)
        return None if request is None or request.is_finished else request
