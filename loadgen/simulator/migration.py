"""Migration in the simulator: pairing rounds with the shared policy, and a model of Llumnix's
multi-stage live migration on top of the simulated engine's own migration hooks.

Stages follow the live source's rule (`next_stage`, the same `StageRule`): while the request
keeps decoding on the source, a stage reserves its blocks on the destination (`reserve`) and
copies the full blocks added since the previous stage; once few are new (or at the stage
limit), the source suspends the request, the rest is copied during the downtime, and the move
commits: `suspend` → `add_migrated` → `release_migrated`. A request that finishes or is
preempted on the source meanwhile aborts the migration and frees the lease.

Cache-aware (`MigrationModel.cache_aware`, issue 18 §4): pairing prefers a destination whose
prefix cache holds the request each source would move (`CacheAffinity`), and at the start the
destination pins the cached blocks of the request's leading prefix (`pin_cached_prefix`): the
stages copy only the blocks after them, and the request's table there starts with them.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loadgen.simulator.instance import InstanceState, SimInstance
from shared.engine_model.request import RequestStatus, SimRequest
from shared.engine_model.scheduler import SimScheduler
from shared.policy.disaggregation import rebalancing_pairs
from shared.policy.freeness import QueueDemand, freeness
from shared.policy.migration import (
    MigrationCandidate,
    MigrationGuard,
    is_migratable,
    may_migrate_into,
    may_move,
    next_stage,
    pair_migrations,
    select_request_to_migrate,
)

if TYPE_CHECKING:
    from loadgen.simulator.cluster import ClusterSimulator


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
    handoff: bool = False  # a P/D hand-off at the first token, not a load-balancing move

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


def migration_candidates(
    scheduler: SimScheduler, placed_at: dict[str, float], now: float, guard: MigrationGuard | None,
    dst: str = "", left_at: dict[str, dict[str, float]] | None = None,
) -> list[MigrationCandidate]:
    """Decoding requests that may move to `dst` by the live source's per-request limits
    (`may_move`: residence here, no early return to an instance they left; no limits without a
    guard). `left_at`: request id -> instance -> when the request last left it."""
    left_at = left_at or {}
    candidates = []
    for r in scheduler.running:
        if not is_decoding(r):
            continue
        if guard is not None:
            left = left_at.get(r.request_id, {}).get(dst)
            if not may_move(residence_s=now - placed_at[r.request_id],
                            left_destination_s_ago=None if left is None else now - left, guard=guard):
                continue
        candidates.append(MigrationCandidate(r.request_id, r.priority, r.num_tokens))
    return candidates


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
    clone.preemption_loss_s = request.preemption_loss_s
    clone.num_recomputed_tokens = request.num_recomputed_tokens
    return clone


class Migrator:
    def __init__(self, sim: ClusterSimulator) -> None:
        self.sim = sim
        self.model = sim.config.migration
        self.guard = sim.config.guard
        self.block_bytes = sim.config.block_bytes
        self.pairs: dict[str, str] = {}  # source -> destination, as of the last round
        self.active: dict[str, Migration] = {}  # migration id -> migration
        self.stats = MigrationStats()
        self.left_at: dict[str, dict[str, float]] = {}  # request id -> instance -> when it left it
        # Told of every migration's end (committed or aborted, after the slots are freed): the
        # P/D hand-offs, which wait for a free slot.
        self.on_finished: Callable[[Migration], None] | None = None
        self._ids = 0

    @property
    def in_flight(self) -> int:
        return len(self.active)

    # -- rounds ----------------------------------------------------------------------------------

    def on_round(self, _: object) -> None:
        sim = self.sim
        if sim.done:
            return
        sim.events.push(sim.now + sim.config.migration_interval_s, self.on_round)
        loads = sim.loads()
        config = sim.policy_config
        if sim.config.disaggregated:
            pairs = rebalancing_pairs(loads, config, self.guard)
        elif self.model.cache_aware:
            pairs = pair_migrations(loads, config, self.guard, self._cached_prefix, self.model.affinity)
        else:
            pairs = pair_migrations(loads, config, self.guard)
        self.pairs = {pair.src: pair.dst for pair in pairs}
        self.stats.rounds += 1
        self.stats.pairs += len(pairs)
        for pair in pairs:
            self._try_start(sim.instances[pair.src], sim.instances[pair.dst])

    def _cached_prefix(self, src_id: str) -> dict[str, int]:
        """Destination -> leading blocks of the request `src_id` would move (by the selection
        rule, the residence guard left out, as a live source reports it) that its prefix cache
        holds: what a live scheduler's prefix index answers."""
        sim = self.sim
        src = sim.instances[src_id]
        busy = {m.request_id for m in self.active.values()}
        candidates = migration_candidates(src.scheduler, sim.placed_at, sim.now, None)
        chosen = select_request_to_migrate([c for c in candidates if c.request_id not in busy])
        if chosen is None:
            return {}
        request = src.scheduler.get(chosen.request_id)
        hashes = request.block_hashes[:request.num_computed_tokens // src.scheduler.block_size]
        if not hashes:
            return {}
        held = {}
        for instance in sim.serving:
            cache = instance.scheduler.prefix_cache
            if instance is not src and cache is not None and cache.holds(hashes[0]):
                held[instance.instance_id] = cache.matched_blocks(hashes)
        return held

    def _pair_stands(self, src: SimInstance, dst: SimInstance) -> bool:
        """The source keeps migrating while it is still short of memory and the destination
        still has plenty, as its own fresh load shows."""
        if self.pairs.get(src.instance_id) != dst.instance_id or dst.state is not InstanceState.LIVE:
            return False
        config = self.sim.policy_config
        src_f = freeness(self.sim.report_of(src, fresh=True), config.headroom_blocks, QueueDemand.HEAD)
        dst_f = freeness(self.sim.report_of(dst, fresh=True), config.headroom_blocks, QueueDemand.HEAD)
        gap = self.guard.min_freeness_gap if self.guard else 0.0
        return src_f < config.migrate_out_freeness and dst_f > config.migrate_in_freeness and dst_f - src_f >= gap

    def _try_start(self, src: SimInstance, dst: SimInstance) -> bool:
        limit = self.model.max_per_instance
        if src.migrations_out >= limit or dst.migrations_in >= limit or not dst.serving:
            return False
        sim = self.sim
        busy = {m.request_id for m in self.active.values()}
        candidates = migration_candidates(src.scheduler, sim.placed_at, sim.now, self.guard, dst.instance_id,
                                          self.left_at)
        candidates = [c for c in candidates if c.request_id not in busy]
        chosen = select_request_to_migrate(candidates)
        if chosen is None:
            return False
        if self.guard is not None:
            blocks = src.scheduler.block_manager.num_blocks_of(chosen.request_id)
            report = sim.report_of(dst)
            if not may_migrate_into(num_blocks=blocks, num_blocks_free=report.num_blocks_free,
                                    num_blocks_total=report.num_blocks_total, num_waiting=report.num_waiting,
                                    guard=self.guard, draining=report.draining,
                                    num_blocks_committed=report.committed_blocks):
                return False
        self.start(src, dst, chosen.request_id)
        return True

    def start(self, src: SimInstance, dst: SimInstance, request_id: str, *, handoff: bool = False) -> Migration:
        """Move a decoding request from `src` to `dst`, stage by stage; the caller checked the
        slots, the guard and that the request decodes. `handoff`: a P/D hand-off (issue 19)."""
        out_limit = self.model.handoff_concurrency if handoff else self.model.max_per_instance
        assert src.migrations_out < out_limit and dst.migrations_in < self.model.max_per_instance
        self._ids += 1
        migration = Migration(f"m{self._ids}", request_id, src, dst, started_at=self.sim.now, handoff=handoff)
        self.active[migration.migration_id] = migration
        src.migrations_out += 1
        dst.migrations_in += 1
        self.stats.started += 1
        if self.model.cache_aware:
            self._pin_cached_prefix(migration)
        self._next_stage(migration)
        return migration

    def _pin_cached_prefix(self, migration: Migration) -> None:
        """The destination binds to the cached blocks of the request's prefix before any stage:
        they count as on the destination already (sent and leased), so no stage copies them."""
        request = migration.src.scheduler.get(migration.request_id)
        full = request.num_computed_tokens // migration.src.scheduler.block_size
        pinned = migration.dst.scheduler.pin_cached_prefix(migration.lease_id, request.block_hashes, full)
        migration.cached_blocks = migration.blocks_sent = migration.lease_blocks = pinned
        self.stats.cached_blocks += pinned

    # -- stages ----------------------------------------------------------------------------------

    def _next_stage(self, migration: Migration) -> None:
        """The live source's decision (`next_stage`): copy the full blocks the request gained
        since the last stage while it keeps decoding, or suspend it and copy the rest."""
        scheduler = migration.src.scheduler
        request = scheduler.get(migration.request_id)
        full = request.num_computed_tokens // scheduler.block_size  # blocks whose content is final
        num_blocks = next_stage(self.model.stages, migration.stage, full, migration.blocks_sent)
        if num_blocks is None:
            self._last_stage(migration)
            return
        if not self._reserve_held_blocks(migration):
            return
        self._start_stage(migration, num_blocks, self.model.stage_overhead_s)

    def _last_stage(self, migration: Migration) -> None:
        if not self._reserve_held_blocks(migration):
            return
        suspended = migration.src.scheduler.suspend(migration.request_id)
        assert suspended, migration  # checked decoding just before
        migration.status = MigrationStatus.STOPPED
        migration.suspended_at = self.sim.now
        self._start_stage(migration, migration.lease_blocks - migration.blocks_sent, self.model.commit_overhead_s)

    def _reserve_held_blocks(self, migration: Migration) -> bool:
        """Top the lease up to every block the request holds, the partial one included (as a
        live PRE-ALLOC does); False (aborted) when the destination is out of blocks."""
        held = migration.src.scheduler.block_manager.num_blocks_of(migration.request_id)
        more = held - migration.lease_blocks
        if more > 0 and migration.dst.scheduler.reserve(migration.lease_id, more) is None:
            self._abort(migration, "destination out of blocks")
            return False
        migration.lease_blocks = max(held, migration.lease_blocks)
        return True

    def _start_stage(self, migration: Migration, num_blocks: int, overhead_s: float) -> None:
        migration.stage += 1
        migration.stage_blocks = num_blocks
        migration.stages.append((num_blocks, migration.status is MigrationStatus.STOPPED))
        duration = overhead_s + self.model.copy_s(num_blocks, self.block_bytes)
        self.sim.events.push(self.sim.now + duration, self._on_stage_end, migration)

    def _on_stage_end(self, migration: Migration) -> None:
        request = migration.src.scheduler.get(migration.request_id)
        if migration.status is not MigrationStatus.STOPPED and (request is None or not is_decoding(request)):
            self._abort(migration, "finished on the source" if request is None else "preempted on the source")
            return
        migration.blocks_sent += migration.stage_blocks
        self.stats.copied_blocks += migration.stage_blocks
        if migration.status is MigrationStatus.STOPPED:
            self._commit(migration, request)
        else:
            self._next_stage(migration)

    # -- endings ---------------------------------------------------------------------------------

    def close(self) -> None:
        """The run is over: migrations still copying moved requests that have finished since;
        drop their leases so every instance ends empty."""
        for migration in list(self.active.values()):
            assert migration.status is MigrationStatus.COPYING, migration
            self._abort(migration, "run ended")

    def _commit(self, migration: Migration, request: SimRequest | None) -> None:
        assert request is not None and request.status is RequestStatus.SUSPENDED, migration
        src, dst, sim = migration.src, migration.dst, self.sim
        clone = clone_for_destination(request)
        dst.scheduler.add_migrated(clone, migration.lease_id)
        released = src.scheduler.release_migrated(migration.request_id, sim.now)
        assert released, migration
        sim.placed_at[migration.request_id] = sim.now
        self.left_at.setdefault(migration.request_id, {})[src.instance_id] = sim.now
        migration.status = MigrationStatus.COMMITTED
        self.stats.committed += 1
        self.stats.downtime_s.append(sim.now - migration.suspended_at)
        self.stats.duration_s.append(sim.now - migration.started_at)
        self._finish(migration)
        if self._pair_stands(src, dst):
            self._try_start(src, dst)

    def _abort(self, migration: Migration, reason: str) -> None:
        migration.dst.scheduler.release(migration.lease_id)
        if migration.status is MigrationStatus.STOPPED:
            migration.src.scheduler.resume(migration.request_id)
        migration.status = MigrationStatus.ABORTED
        self.stats.aborted[reason] += 1
        self._finish(migration)

    def _finish(self, migration: Migration) -> None:
        del self.active[migration.migration_id]
        migration.src.migrations_out -= 1
        migration.dst.migrations_in -= 1
        for instance in (migration.src, migration.dst):
            self.sim.kick(instance)  # blocks were freed or a request joined the batch
            self.sim.maybe_stop(instance)
        if self.on_finished is not None:
            self.on_finished(migration)
