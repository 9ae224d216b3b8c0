"""Source side of live migration: the pair the global scheduler ordered, the loop that keeps
migrating requests to it, and the multi-stage protocol for one request.

The request stays untouched on the source until the destination has committed: every stage
re-checks it after every await (finished, aborted, preempted, stopping → ABORT to the
destination, the request goes on here), and only the last stage takes it out of the batch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.handshake import DestinationLink
from services.llumlet.migration.ops import LivePhase, MigratableEngine, MigrationSnapshot
from services.llumlet.migration.protocol import (
    ALREADY_COMMITTED,
    DestinationGone,
    DestinationRefused,
    DestinationSlow,
    MigrationFailed,
    MigrationLifecycle,
    MigrationLimits,
    MigrationStatus,
    SourceAborted,
    new_migration_id,
)
from services.llumlet.migration.transfer import KVSenderPool, StageTransfer
from shared.messages import MigrateOrder, MigrationAbort, PreAlloc
from shared.policy.migration import select_request_to_migrate

log = logging.getLogger(__name__)

_HISTORY = 256  # ended migrations kept for stats and tests


class SourceHooks(Protocol):
    """What the coordinator needs from its llumlet."""

    def migrated_out(self, request_id: str) -> None:
        """The destination committed: stop publishing for the request (before it is released)."""

    def resumed(self) -> None:
        """A suspended request is back in the batch: wake the engine loop."""

    def changed(self) -> None:
        """Migration state changed: publish a load report soon."""

    async def fail_request(self, request_id: str, reason: str) -> None:
        """The request cannot go on anywhere we know of: end it with an error to the client."""


@dataclass
class StageRecord:
    stage: int
    num_blocks: int
    num_bytes: int
    seconds: float  # the copy: fusion, wire, scatter and acks
    prealloc_s: float  # the PRE-ALLOC round trip before it
    final: bool


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
    lease_blocks: int = 0  # blocks the destination has reserved for us
    kv_address: str = ""
    stages: list[StageRecord] = field(default_factory=list)
    started_at: float = 0.0
    suspended_at: float | None = None
    commit_s: float = 0.0  # the COMMIT round trip
    ended_at: float | None = None

    @property
    def downtime_s(self) -> float | None:
        """Out of the batch: suspend → committed on the destination (as the source saw it)."""
        if self.suspended_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.suspended_at


@dataclass
class _Pair:
    pair_id: str
    dst: str
    expires_at: float
    backoff_until: float = 0.0


class MigrationCoordinator:
    def __init__(self, instance_id: str, ops: MigratableEngine, copier: BlockCopier, link: DestinationLink,
                 senders: KVSenderPool, limits: MigrationLimits, hooks: SourceHooks,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.instance_id = instance_id
        self.ops = ops
        self.copier = copier
        self.link = link
        self.senders = senders
        self.limits = limits
        self.hooks = hooks
        self._clock = clock
        self._pair: _Pair | None = None
        self._active: dict[str, OutgoingMigration] = {}  # by request id
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self.history: collections.deque[OutgoingMigration] = collections.deque(maxlen=_HISTORY)

    # -- orders from the global scheduler ------------------------------------------------------

    def on_order(self, order: MigrateOrder) -> None:
        """Idempotent: a repeated order re-confirms the pair; a cancel ends it (no new migration
        starts; one in flight completes)."""
        pair = self._pair
        if order.cancel:
            if pair is not None and pair.pair_id == order.pair_id:
                self._pair = None
            return
        if order.dst_instance_id == self.instance_id:
            log.warning("ignoring an order to migrate to ourselves (%s)", order.pair_id)
            return
        expires = self._clock() + self.limits.pair_ttl_s
        if pair is not None and pair.pair_id == order.pair_id and pair.dst == order.dst_instance_id:
            pair.expires_at = expires
        else:
            self._pair = _Pair(order.pair_id, order.dst_instance_id, expires)
            self._wake.set()

    def current_destination(self) -> str | None:
        pair = self._pair
        if pair is None or pair.expires_at < self._clock():
            return None
        return pair.dst

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- the loop that keeps migrating while we are a source ----------------------------------

    async def run(self) -> None:
        while True:
            request_id, dst = self._next_migration()
            if request_id is None:
                self._wake.clear()
                # With a pair, look again soon (requests start decoding, the pair lapses);
                # without one, only an order (or a migration ending) wakes us.
                timeout_s = self.limits.idle_poll_s if self._pair is not None else None
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout_s)
                except TimeoutError:
                    pass
                continue
            m = self._begin(request_id, dst)  # takes its slot now, before the task first runs
            if m is not None:
                self._spawn(m)
            await asyncio.sleep(0)

    def _spawn(self, m: OutgoingMigration) -> asyncio.Task:
        task = asyncio.create_task(self._drive(m), name=f"migrate-{m.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _next_migration(self) -> tuple[str | None, str]:
        dst = self.current_destination()
        if dst is None or self._stopping or len(self._active) >= self.limits.max_out:
            return None, ""
        if self._pair.backoff_until > self._clock():
            return None, ""
        candidates = [c for c in self.ops.migration_candidates() if c.request_id not in self._active]
        choice = select_request_to_migrate(candidates)
        return (choice.request_id, dst) if choice is not None else (None, "")

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("migration task failed", exc_info=task.exception())
        self._wake.set()

    async def stop(self) -> None:
        """Abort what is in flight (requests resume here); the destinations' leases lapse or
        get our ABORT."""
        self._stopping = True
        self._pair = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one request -----------------------------------------------------------------------------

    async def migrate(self, request_id: str, dst: str) -> OutgoingMigration | None:
        """Migrate one running request to `dst` and return how it ended; None if it is not
        running here. The migration runs in a task of ours, so `stop()` aborts it too."""
        m = self._begin(request_id, dst)
        if m is not None:
            await asyncio.wait([self._spawn(m)])
        return m

    def _begin(self, request_id: str, dst: str) -> OutgoingMigration | None:
        snapshot = self.ops.migration_snapshot(request_id)
        if snapshot is None or snapshot.phase is not LivePhase.RUNNING or request_id in self._active:
            return None
        m = OutgoingMigration(new_migration_id(), request_id, dst, snapshot.num_preemptions, started_at=self._clock())
        self._active[request_id] = m
        self.hooks.changed()
        return m

    async def _drive(self, m: OutgoingMigration) -> None:
        request_id = m.request_id
        try:
            await self._run_stages(m)
            await self._commit(m)
        except MigrationFailed as exc:
            await self._abort(m, exc)
        except asyncio.CancelledError:
            await self._abort(m, SourceAborted("source stopping"))
            raise
        finally:
            del self._active[request_id]
            self.history.append(m)
            self.hooks.changed()

    async def _run_stages(self, m: OutgoingMigration) -> None:
        block_size = self.ops.block_size
        while True:
            snapshot = self._check(m, LivePhase.RUNNING)
            full = snapshot.num_computed_tokens // block_size  # blocks whose content is final
            final = m.stage >= self.limits.stage_limit - 1 or full - m.blocks_sent <= self.limits.last_stage_blocks
            phase = LivePhase.SUSPENDED if final else LivePhase.RUNNING
            if final:
                if not self.ops.suspend(m.request_id):
                    raise SourceAborted("request left the batch before the last stage")
                m.suspended_at = self._clock()
                full = self._check(m, phase).num_blocks  # everything, the partial block too
            await self._stage(m, full, final, phase)
            if final:
                return

    async def _stage(self, m: OutgoingMigration, upto: int, final: bool, phase: LivePhase) -> None:
        """Copy request blocks [blocks_sent, upto) into lease blocks of the same indices."""
        block_ids = self.ops.block_ids_of(m.request_id)[m.blocks_sent : upto]
        asked = self._clock()
        await self._prealloc(m, upto - m.lease_blocks)
        self._check(m, phase)
        started = self._clock()
        transfer = StageTransfer(0, 0, 0, 0.0)
        if block_ids:
            transfer = await self.senders.send_stage(m.kv_address, m.migration_id, m.stage, m.blocks_sent,
                                                     block_ids, self.copier, lambda: self._check(m, phase))
            self._check(m, phase)
        m.stages.append(StageRecord(m.stage, len(block_ids), transfer.num_bytes, self._clock() - started,
                                    started - asked, final))
        m.blocks_sent = upto
        m.stage += 1

    async def _prealloc(self, m: OutgoingMigration, num_blocks: int) -> None:
        msg = PreAlloc(m.migration_id, m.request_id, num_blocks, self.limits.lease_s, m.stage)
        grant = await self.link.prealloc(m.dst, msg)
        if not grant.ok:
            raise DestinationRefused(f"pre-alloc refused: {grant.reason}")
        if len(grant.block_ids) != num_blocks or not grant.kv_address:
            raise DestinationRefused(f"bad pre-alloc grant ({len(grant.block_ids)} of {num_blocks} blocks)")
        m.lease_blocks += num_blocks
        m.kv_address = grant.kv_address

    def _check(self, m: OutgoingMigration, phase: LivePhase) -> MigrationSnapshot:
        """After every await: is the request still where the migration left it?"""
        if self._stopping:
            raise SourceAborted("source stopping")
        snapshot = self.ops.migration_snapshot(m.request_id)
        if snapshot is None:
            raise SourceAborted("request finished or was aborted")
        if snapshot.num_preemptions != m.num_preemptions:
            raise SourceAborted("request was preempted")
        if snapshot.phase is not phase:
            raise SourceAborted(f"request is {snapshot.phase.value}, expected {phase.value}")
        return snapshot

    # -- commit and abort --------------------------------------------------------------------------

    async def _commit(self, m: OutgoingMigration) -> None:
        commit = self.ops.migration_commit(m.request_id, m.migration_id)
        asked = self._clock()
        committed = await self._ask_commit(m, commit)
        m.commit_s = self._clock() - asked
        if committed is None:  # nobody knows: the request cannot go on anywhere for sure
            m.abort(MigrationStatus.ABORTED_DST, "commit outcome unknown", self._clock())
            await self.hooks.fail_request(m.request_id, "migration outcome unknown")
            return
        self.hooks.migrated_out(m.request_id)  # no await since the ack: nothing published meanwhile
        self.ops.release_migrated(m.request_id)  # (False if the client aborted it meanwhile)
        m.finish(self._clock())
        log.info("migrated %s to %s in %d stages (downtime %.1f ms)", m.request_id, m.dst, m.stage,
                 1e3 * (m.downtime_s or 0.0))

    async def _ask_commit(self, m: OutgoingMigration, commit) -> bool | None:
        """True: committed there. Raises (→ abort, the request resumes here) when it surely was
        not. None: no answer at all until the deadline."""
        for attempt in range(self.limits.commit_attempts):
            try:
                ack = await self.link.commit(m.dst, commit)
            except DestinationSlow:
                log.warning("commit of %s to %s unanswered (attempt %d)", m.request_id, m.dst, attempt + 1)
                continue
            if not ack.ok:
                raise DestinationRefused(f"commit refused: {ack.error}")
            return True
        return await self._resolve_in_doubt(m)

    async def _resolve_in_doubt(self, m: OutgoingMigration) -> bool | None:
        """ABORT is decisive: either it lands first (never committed, now never will) or the
        destination answers that it has committed already."""
        deadline = self._clock() + self.limits.in_doubt_deadline_s
        while self._clock() < deadline:
            try:
                ack = await self.link.abort(m.dst, MigrationAbort(m.migration_id, "commit unanswered"))
            except DestinationSlow:
                await asyncio.sleep(self.limits.abort_timeout_s)
                continue
            if ack.ok:
                raise DestinationSlow("commit unanswered; aborted")
            if ack.error == ALREADY_COMMITTED:
                return True
            raise DestinationRefused(f"abort after an unanswered commit: {ack.error}")
        return None

    async def _abort(self, m: OutgoingMigration, exc: MigrationFailed) -> None:
        m.abort(exc.status, str(exc), self._clock())
        log.info("migration of %s to %s aborted (%s): %s", m.request_id, m.dst, m.status.value, exc)
        snapshot = self.ops.migration_snapshot(m.request_id)
        if snapshot is not None and snapshot.phase is LivePhase.SUSPENDED and self.ops.resume(m.request_id):
            self.hooks.resumed()  # the request goes on here as if nothing happened
        if m.status is MigrationStatus.ABORTED_DST and self._pair is not None and self._pair.dst == m.dst:
            self._pair.backoff_until = self._clock() + self.limits.refused_backoff_s
        if isinstance(exc, DestinationGone):
            return  # nobody there to release anything
        try:
            await self.link.abort(m.dst, MigrationAbort(m.migration_id, str(exc)))
        except MigrationFailed as abort_exc:
            log.info("ABORT of %s not delivered (%s); its lease will expire", m.migration_id, abort_exc)
