"""Migration in the simulator: pairing rounds with the shared policy, and a model of Llumnix's
multi-stage live migration on top of the simulated engine's own migration hooks.

Stages follow the live source's rule (`next_stage`, the same `StageRule`): while the request
keeps decoding on the source, a stage reserves its blocks on the destination (`reserve`) and
copies the full blocks added since the previous stage; once few are new (or at the stage
limit), the source suspends the request, the rest is copied during the downtime, and the move
commits: `suspend` → `add_migrated` → `release_migrated`. A request that finishes or is
preempted on the source meanwhile aborts the migration and frees the lease.

Cache-aware (`MigrationModel.cache_aware`, on wherever the engines cache prefixes, as the
services; issue 18 §4): pairing prefers a destination whose
prefix cache holds the request each source would move (`CacheAffinity`), and at the start the
destination pins the cached blocks of the request's leading prefix (`pin_cached_prefix`): the
stages copy only the blocks after them, and the request's table there starts with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from loadgen.simulator.handover import Handovers
from loadgen.simulator.instance import InstanceState, SimInstance
from loadgen.simulator.migration_state import (
    Migration,
    MigrationStats,
    MigrationStatus,
    clone_for_destination,
    is_decoding,
)
from shared.engine_model.request import RequestStatus, SimRequest
from shared.engine_model.scheduler import SimScheduler
from shared.messages import MAX_CANDIDATE_HASHES, MAX_PREALLOC_HASHES
from shared.policy.disaggregation import rebalancing_pairs
from shared.policy.migration import (
    MigrationCandidate,
    MigrationGuard,
    may_migrate_into,
    may_move,
    next_stage,
    select_request_to_migrate,
)

if TYPE_CHECKING:
    from loadgen.simulator.cluster import ClusterSimulator


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


class Migrator:
    def __init__(self, sim: ClusterSimulator) -> None:
        self.sim = sim
        self.model = sim.config.migration
        # (an engine without a prefix cache holds nothing to pair by or to pin)
        self.cache_aware = self.model.cache_aware and sim.config.scheduler.enable_prefix_caching
        self.guard = sim.config.guard
        self.block_bytes = sim.config.block_bytes
        self.pairs: dict[str, str] = {}  # source -> destination, as of the last round
        self._refused: dict[str, tuple[str, float]] = {}  # source -> (destination, backing off until)
        self._polling: dict[str, str] = {}  # source -> the destination it looks again for, soon
        self.active: dict[str, Migration] = {}  # migration id -> migration
        self.stats = MigrationStats()
        self.left_at: dict[str, dict[str, float]] = {}  # request id -> instance -> when it left it
        # Told of every migration's end (committed or aborted, after the slots are freed): the
        # P/D hand-offs, which wait for a free slot.
        self.on_finished: Callable[[Migration], None] | None = None
        self._ids = 0
        self.handovers = Handovers(self.model.hold, self.stats, self.model.notice_steps,
                                   wake=lambda dst, at: sim.events.push(at, sim.kick, dst))

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
        # (as the live pairer: `rebalancing_pairs` for every fleet, exactly `pair_migrations` without
        # prefill instances; the caches matched where the engines cache)
        cached_prefix = self._cached_prefix if self.cache_aware else None
        pairs = rebalancing_pairs(loads, config, self.guard, cached_prefix, self.model.affinity)
        self.pairs = {pair.src: pair.dst for pair in pairs}
        # (a back-off lasts while its pair stands: a live source's is on the pair it was ordered)
        self._refused = {src: refused for src, refused in self._refused.items() if self.pairs.get(src) == refused[0]}
        self.stats.rounds += 1
        self.stats.pairs += len(pairs)
        for pair in pairs:
            self._keep_migrating(sim.instances[pair.src], sim.instances[pair.dst])

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
        # (a live source reports at most MAX_CANDIDATE_HASHES in its load report)
        hashes = request.block_hashes[:min(request.num_computed_tokens // src.scheduler.block_size,
                                           MAX_CANDIDATE_HASHES)]
        if not hashes:
            return {}
        held = {}
        for instance in sim.serving:
            cache = instance.scheduler.prefix_cache
            if instance is not src and cache is not None and cache.holds(hashes[0]):
                held[instance.instance_id] = cache.matched_blocks(hashes)
        return held

    def _backing_off(self, src: SimInstance, dst: SimInstance) -> bool:
        refused = self._refused.get(src.instance_id)
        return refused is not None and refused[0] == dst.instance_id and self.sim.now < refused[1]

    def refused_by(self, src: SimInstance, dst: SimInstance) -> None:
        """The destination refused or aborted a migration: none to it for a while, while the pair stands."""
        if self.pairs.get(src.instance_id) == dst.instance_id:
            self._refused[src.instance_id] = (dst.instance_id, self.sim.now + self.model.refused_backoff_s)

    def _keep_migrating(self, src: SimInstance, dst: SimInstance) -> None:
        """As a live source's loop while its pair stands (until the next round pairs otherwise):
        the next migration starts as soon as a slot is free, and where none may start (no
        candidate decoding, a back-off), it looks again after `idle_poll_s`. (A slot taken: the
        migration's end comes back here.)"""
        if self.sim.done or self.pairs.get(src.instance_id) != dst.instance_id:
            return
        while src.migrations_out < self.model.max_out and self._try_start(src, dst):
            pass  # (every free slot, as the live loop fills them)
        if src.migrations_out >= self.model.max_out:
            return
        if self._polling.get(src.instance_id) != dst.instance_id:
            self._polling[src.instance_id] = dst.instance_id
            self.sim.events.push(self.sim.now + self.model.idle_poll_s, self._poll, (src, dst))

    def _slot_freed(self, src: SimInstance) -> None:
        """A migration of this source ended (a hand-off too): its loop wakes for its pair now."""
        dst_id = self.pairs.get(src.instance_id)
        if dst_id is not None:
            self._keep_migrating(src, self.sim.instances[dst_id])

    def _poll(self, pair: tuple[SimInstance, SimInstance]) -> None:
        src, dst = pair
        if self._polling.get(src.instance_id) == dst.instance_id:
            del self._polling[src.instance_id]
        self._keep_migrating(src, dst)

    def _try_start(self, src: SimInstance, dst: SimInstance) -> bool:
        if src.migrations_out >= self.model.max_out or not dst.serving or self._backing_off(src, dst):
            return False
        sim = self.sim
        busy = {m.request_id for m in self.active.values()}
        candidates = migration_candidates(src.scheduler, sim.placed_at, sim.now, self.guard, dst.instance_id,
                                          self.left_at)
        candidates = [c for c in candidates if c.request_id not in busy]
        chosen = select_request_to_migrate(candidates)
        if chosen is None:
            return False
        if not self.destination_grants(dst, src.scheduler.block_manager.num_blocks_of(chosen.request_id)):
            self.refused_by(src, dst)
            return False
        self.start(src, dst, chosen.request_id)
        return True

    def destination_grants(self, dst: SimInstance, num_blocks: int) -> bool:
        """Whether the destination grants a new migration's first PRE-ALLOC, as a live one
        decides it (`IncomingMigrations._refuse_new`): not draining, under its limit of migrations
        in, and past its guard on its state now (not on the report the pairing went by)."""
        return (dst.state is InstanceState.LIVE and dst.migrations_in < self.model.max_in
                and self._may_take_more(dst, num_blocks))

    def start(self, src: SimInstance, dst: SimInstance, request_id: str, *, handoff: bool = False) -> Migration:
        """Move a decoding request from `src` to `dst`, stage by stage; the caller checked the
        slots, the guard and that the request decodes. `handoff`: a P/D hand-off (issue 19)."""
        out_limit = self.model.handoff_concurrency if handoff else self.model.max_out
        assert src.migrations_out < out_limit and dst.migrations_in < self.model.max_in
        self._ids += 1
        migration = Migration(f"m{self._ids}", request_id, src, dst, started_at=self.sim.now, handoff=handoff)
        self.active[migration.migration_id] = migration
        src.migrations_out += 1
        dst.migrations_in += 1
        self.stats.started += 1
        self._report(src)  # (the destination's, once its blocks are reserved)
        if self.cache_aware:
            self._pin_cached_prefix(migration)
        if handoff and src.step is None:
            # As the llumlet: a hand-off that starts between steps (right after the one that gave
            # the first token) takes the request out of the batch before the next, which may
            # carry other prompts' prefill, and moves it in one stage (with no notice: no hold).
            self._last_stage(migration, noticed=False)
        else:
            self._next_stage(migration)
        return migration

    def _pin_cached_prefix(self, migration: Migration) -> None:
        """The destination binds to the cached blocks of the request's prefix before any stage:
        they count as on the destination already (sent and leased), so no stage copies them."""
        request = migration.src.scheduler.get(migration.request_id)
        full = request.num_computed_tokens // migration.src.scheduler.block_size
        # (a live source's first PRE-ALLOC names at most MAX_PREALLOC_HASHES)
        pinned = migration.dst.scheduler.pin_cached_prefix(migration.lease_id, request.block_hashes,
                                                           min(full, MAX_PREALLOC_HASHES))
        migration.cached_blocks = migration.blocks_sent = migration.lease_blocks = pinned
        self.stats.cached_blocks += pinned
        if pinned:
            self._report(migration.dst)

    # -- stages ----------------------------------------------------------------------------------

    def _next_stage(self, migration: Migration) -> None:
        """The live source's decision (`next_stage`): copy the full blocks the request gained
        since the last stage while it keeps decoding, or suspend it and copy the rest."""
        scheduler = migration.src.scheduler
        request = scheduler.get(migration.request_id)
        full = request.num_computed_tokens // scheduler.block_size  # blocks whose content is final
        if migration.stage == 0:
            # A live source decides its first stage before it learns what the destination holds
            # cached (that stage's grant tells it): it copies what the cache lacks, if nothing.
            first = next_stage(self.model.stages, 0, full, 0)
            num_blocks = None if first is None else full - migration.blocks_sent
        else:
            num_blocks = next_stage(self.model.stages, migration.stage, full, migration.blocks_sent)
        if num_blocks is None:
            self._last_stage(migration)
            return
        if not self._reserve_held_blocks(migration):
            return
        self._start_stage(migration, num_blocks, self.model.stage_overhead_s)

    def _last_stage(self, migration: Migration, noticed: bool = True) -> None:
        """Suspend the request (after the source's step in flight) and copy the rest. `noticed`:
        the destination was told the commit is coming and may hold a step for it (a live source
        notices while the request still decodes; a hand-off taken out of the batch at its first
        token moves without one)."""
        src = migration.src
        last_stage_s = self.model.commit_overhead_s + self.model.copy_s(
            migration.lease_blocks - migration.blocks_sent, self.block_bytes)
        if self.handovers.suspend_waits(migration, src.scheduler.get(migration.request_id), last_stage_s,
                                        self.sim.now):
            return  # (`on_step_end` comes back here)
        if not self._reserve_held_blocks(migration):
            return
        suspended = src.scheduler.suspend(migration.request_id)
        assert suspended, migration  # checked decoding just before
        migration.status = MigrationStatus.STOPPED
        migration.suspended_at = self.sim.now
        ends_at = self._start_stage(migration, migration.lease_blocks - migration.blocks_sent,
                                    self.model.commit_overhead_s)
        if noticed and migration.commit_due_at is None:  # (noticed while it decoded: that estimate stands)
            self.handovers.expect_commit(migration, ends_at)

    def on_step_end(self, instance: SimInstance, new_token: list[SimRequest]) -> None:
        """The instance's step ended: committed requests' first tokens end their stalls, and the
        last stages that waited for the step suspend their requests now (or abort, where the
        request finished or was preempted in it)."""
        self.handovers.new_tokens(new_token, self.sim.now)
        for migration in self.handovers.after_step(instance):
            request = instance.scheduler.get(migration.request_id)
            if request is None or not is_decoding(request):
                self._abort(migration, "finished on the source" if request is None else "preempted on the source")
            else:
                self._last_stage(migration)

    def holds_step(self, dst: SimInstance, now: float) -> bool:
        return self.handovers.holds_step(dst, now)

    def step_started(self, instance: SimInstance) -> None:
        self.handovers.step_started(instance)

    def _reserve_held_blocks(self, migration: Migration) -> bool:
        """Top the lease up to every block the request holds, the partial one included (as a
        live PRE-ALLOC does); False (aborted) when the destination refuses them or is out of
        blocks. Blocks past the first grant pass the guard the first did, on the destination's
        state now (as a live destination's `_guard_more`)."""
        held = migration.src.scheduler.block_manager.num_blocks_of(migration.request_id)
        more = held - migration.lease_blocks
        if more > 0:
            refusal = None
            if migration.stages and not self._may_take_more(migration.dst, more):
                refusal = "destination refused more blocks"
            elif migration.dst.scheduler.reserve(migration.lease_id, more) is None:
                refusal = "destination out of blocks"
            if refusal is not None:
                self.refused_by(migration.src, migration.dst)
                migration.refused_by_destination = True
                self._abort(migration, refusal)
                return False
            self._report(migration.dst)
        migration.lease_blocks = max(held, migration.lease_blocks)
        return True

    def _may_take_more(self, dst: SimInstance, num_blocks: int) -> bool:
        if self.guard is None:
            return True
        scheduler = dst.scheduler
        return may_migrate_into(num_blocks=num_blocks, num_blocks_free=scheduler.block_manager.num_free,
                                num_blocks_total=scheduler.config.num_blocks, num_waiting=len(scheduler.waiting),
                                guard=self.guard, num_blocks_committed=scheduler.committed_blocks())

    def _start_stage(self, migration: Migration, num_blocks: int, overhead_s: float) -> float:
        """Copy a stage; when it ends."""
        migration.stage += 1
        migration.stage_blocks = num_blocks
        migration.stages.append((num_blocks, migration.status is MigrationStatus.STOPPED))
        ends_at = self.sim.now + overhead_s + self.model.copy_s(num_blocks, self.block_bytes)
        self.sim.events.push(ends_at, self._on_stage_end, migration)
        return ends_at

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
        adopted = dst.scheduler.add_migrated(clone, migration.lease_id)
        assert adopted, migration  # (its pins were looked up by the request's own hashes)
        released = src.scheduler.release_migrated(migration.request_id, sim.now)
        assert released, migration
        sim.placed_at[migration.request_id] = sim.now
        self.left_at.setdefault(migration.request_id, {})[src.instance_id] = sim.now
        migration.status = MigrationStatus.COMMITTED
        self.stats.committed += 1
        self.stats.downtime_s.append(sim.now - migration.suspended_at)
        self.handovers.committed(request)
        self.stats.duration_s.append(sim.now - migration.started_at)
        self._finish(migration)
        self._slot_freed(src)

    def _abort(self, migration: Migration, reason: str) -> None:
        migration.dst.scheduler.release(migration.lease_id)
        if migration.status is MigrationStatus.STOPPED:
            migration.src.scheduler.resume(migration.request_id)
        migration.status = MigrationStatus.ABORTED
        self.stats.aborted[reason] += 1
        self._finish(migration)
        self._slot_freed(migration.src)

    def _report(self, *instances: SimInstance) -> None:
        """A llumlet reports at once when a migration starts, takes blocks or ends (its hooks'
        `changed`; the destination's grants and ends): the scheduler's table sees it then."""
        for instance in instances:
            instance.build_report(self.sim.now, self.sim.config.max_seq_len)

    def _finish(self, migration: Migration) -> None:
        del self.active[migration.migration_id]
        self.handovers.forget(migration)
        migration.src.migrations_out -= 1
        migration.dst.migrations_in -= 1
        self._report(migration.src, migration.dst)
        for instance in (migration.src, migration.dst):
            self.sim.kick(instance)  # blocks were freed or a request joined the batch
            self.sim.maybe_stop(instance)
        if self.on_finished is not None:
            self.on_finished(migration)
