"""The destination's leases on reserved blocks: granting them (the handshake's PRE-ALLOC),
filling them from KV frames, ending them, and the watchdog that frees what a vanished source
left behind. The commit that turns a filled lease into a request is `destination.py`'s.

No NATS here (see `handshake.py`) and no sockets (see `kv_receiver.py`): every method is a plain
decision over the registry, so it is tested directly.

A migration's lease holds its reserved blocks, cumulative over stages, in reservation order:
source block i of the request lands in lease block i, and at commit the lease becomes the
request's block table. Ended migrations stay as tombstones for `tombstone_s`, so a late or
repeated message gets the same answer (idempotency) and a late commit after an abort is refused.

A new migration's first PRE-ALLOC passes the simulator's guard on this instance's own load (no
queue here, enough blocks left free after taking the request: `guard_refusal`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.llumlet.migration.commit_hold import CommitHold
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.kv_wire import AckStatus, FrameHeader
from services.llumlet.migration.ops import IntakeLoad, MigratableEngine
from services.llumlet.migration.protocol import (
    ALREADY_COMMITTED,
    MigrationLifecycle,
    MigrationLimits,
    MigrationStatus,
    PreAllocGrant,
)
from shared.messages import Ack, MigrationAbort, PreAlloc
from shared.policy.migration import may_migrate_into

log = logging.getLogger(__name__)


def guard_refusal(load: IntakeLoad, num_blocks: int, limits: MigrationLimits) -> str | None:
    """Why a request of `num_blocks` may not migrate in, by the policy's guard (the one the
    simulator runs: no queue here, and enough blocks left free afterwards); None: it may."""
    guard = limits.guard()
    if may_migrate_into(num_blocks=num_blocks, num_blocks_free=load.num_blocks_free,
                        num_blocks_total=load.num_blocks_total, num_waiting=load.num_waiting, guard=guard,
                        num_blocks_committed=load.num_blocks_committed):
        return None
    if load.num_waiting > guard.dest_max_waiting:
        return f"busy: {load.num_waiting} requests waiting here"
    left = load.num_blocks_free - load.num_blocks_committed - num_blocks
    owed = f", {load.num_blocks_committed} of them owed to admitted prompts" if load.num_blocks_committed else ""
    return (f"no room: {num_blocks} blocks would leave {left} of {load.num_blocks_total} free{owed} "
            f"(the guard keeps {guard.dest_min_free_fraction_after:.0%})")


@dataclass(eq=False)
class IncomingMigration(MigrationLifecycle):
    migration_id: str
    request_id: str
    expires_at: float
    status: MigrationStatus = MigrationStatus.RUNNING
    reason: str = ""
    block_ids: list[int] = field(default_factory=list)  # the lease, in reservation order
    granted: dict[int, list[int]] = field(default_factory=dict)  # stage → blocks reserved for it
    filled_tokens: int = 0  # lease token positions written so far (frames arrive in order)
    block_size: int = 0  # token slots per block (the engine's)
    cached_blocks: int = 0  # leading lease blocks this engine's prefix cache held: pinned, never sent
    writers: int = 0  # scatters in flight: the lease must not be released under them
    token_buffer: np.ndarray | None = None  # a token frame being received (lent: `open_frame`)
    release_pending: bool = False
    ended_at: float | None = None
    prealloc_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a reservation may await the engine

    @property
    def filled(self) -> int:
        """Lease blocks written whole so far."""
        return self.filled_tokens // self.block_size if self.block_size else 0

    def kv_complete(self, num_computed_tokens: int) -> bool:
        """Every position whose KV the request has computed is written (slots past them, in a
        block not yet full, are the request's to write)."""
        capacity = len(self.block_ids) * self.block_size
        return not self.writers and self.filled_tokens >= min(num_computed_tokens, capacity)


class IncomingLeases:
    """Registry of the leases of migrations into this instance; the KV receiver's `FrameSink`
    but for the commit (`IncomingMigrations` adds it)."""

    def __init__(self, ops: MigratableEngine, copier: BlockCopier, limits: MigrationLimits,
                 refusal: Callable[[], str | None] = lambda: None,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 intake_load: Callable[[], IntakeLoad] | None = None,
                 hold: CommitHold | None = None) -> None:
        self.ops = ops
        self.hold = hold  # None: no hold for imminent commits (grants say hold_max_s 0)
        self.copier = copier
        self.limits = limits
        self.kv_address = ""
        self._refusal = refusal  # e.g. "draining": why we take no migration now (None: we do)
        self._intake_load = intake_load  # this instance's load for the guard (None: no guard)
        self._on_change = on_change
        self._clock = clock
        self._migrations: dict[str, IncomingMigration] = {}
        self.num_asked_total = 0  # new migrations answered, granted or refused (load reports carry it)

    # -- views ---------------------------------------------------------------------------------

    def get(self, migration_id: str) -> IncomingMigration | None:
        return self._migrations.get(migration_id)

    def active(self) -> list[IncomingMigration]:
        return [m for m in self._migrations.values() if m.status is MigrationStatus.RUNNING]

    @property
    def num_active(self) -> int:
        return sum(1 for m in self._migrations.values() if m.status is MigrationStatus.RUNNING)

    # -- handshake -----------------------------------------------------------------------------

    async def handle_prealloc(self, msg: PreAlloc) -> PreAllocGrant:
        """Grant (or refuse) a stage's blocks. Reserving may wait for the engine (a step in
        progress): one PRE-ALLOC of a migration at a time, and the migration re-checked after."""
        m = self._migrations.get(msg.migration_id)
        if m is not None:
            async with m.prealloc_lock:
                return await self._prealloc(m, msg)
        try:  # a new migration: once answered, its blocks show in reports (granted) or never will
            refusal = self._refuse_new(msg)
            if refusal is not None:
                return PreAllocGrant(ok=False, reason=refusal)
            m = self._migrations[msg.migration_id] = IncomingMigration(msg.migration_id, msg.request_id, 0.0,
                                                                       block_size=self.ops.block_size)
            async with m.prealloc_lock:
                return await self._prealloc(m, msg)
        finally:
            self.num_asked_total += 1

    async def _prealloc(self, m: IncomingMigration, msg: PreAlloc) -> PreAllocGrant:
        if m.status.is_over:
            return PreAllocGrant(ok=False, reason=f"migration {m.status.value}")
        if msg.request_id != m.request_id or msg.num_blocks < 0:
            return PreAllocGrant(ok=False, reason="pre-alloc does not match the migration")
        granted = m.granted.get(msg.stage, [])
        if msg.stage not in m.granted and msg.stage != len(m.granted):
            return PreAllocGrant(ok=False, reason=f"stage {msg.stage} out of order (expected {len(m.granted)})")
        # A repeated pre-alloc of a stage gets the same blocks again; one for more blocks tops the
        # stage up (the last stage: the request started a block while the pre-alloc travelled).
        more = msg.num_blocks - len(granted)
        if more > 0 or msg.stage not in m.granted:
            if msg.stage != len(m.granted) and msg.stage != len(m.granted) - 1:
                return PreAllocGrant(ok=False, reason=f"stage {msg.stage} is over: no top-up")
            # Every block past the first grant passes the guard the first one did: a 1-block
            # stage 0 topped up to the whole cache is still a request the guard would refuse.
            refusal = self._guard_more(m, more)
            if refusal is not None:
                self._end(m, MigrationStatus.ABORTED_DST, refusal)
                return PreAllocGrant(ok=False, reason=refusal)
            self._renew(m, msg)  # (first: the watchdog must not expire it while the engine reserves)
            pinned = await self._pin_cached_prefix(m, msg) if msg.block_hashes and not m.granted else []
            added = await self.ops.reserve_blocks(m.migration_id, max(0, more - len(pinned)))
            if m.status.is_over:  # ended meanwhile (ABORT, client abort, stop): its release ran already
                self.ops.release_reservation(m.migration_id)
                return PreAllocGrant(ok=False, reason=f"migration {m.status.value}")
            if added is None:
                self._end(m, MigrationStatus.ABORTED_DST, "no room")
                return PreAllocGrant(ok=False, reason=f"no room for {more} more blocks")
            added = pinned + added
            m.block_ids += added
            granted = m.granted[msg.stage] = granted + added
            if added:
                self._on_change()
        self._renew(m, msg)
        return PreAllocGrant(ok=True, block_ids=list(granted), kv_address=self.kv_address,
                             num_cached_blocks=m.cached_blocks if msg.stage == 0 else 0,
                             hold_max_s=self.hold.hold_max_s if self.hold is not None else 0.0)

    async def _pin_cached_prefix(self, m: IncomingMigration, msg: PreAlloc) -> list[int]:
        """The first grant binds the request to the cached blocks of its prefix held here (issue
        18 §4): they lead the lease, count as written, and the source never sends them."""
        pinned = await self.ops.pin_cached_prefix(m.migration_id, msg.block_hashes, msg.num_blocks)
        m.cached_blocks = len(pinned)
        m.filled_tokens = m.cached_blocks * m.block_size
        return pinned

    def _guard_more(self, m: IncomingMigration, more: int) -> str | None:
        if more <= 0 or not m.granted or self._intake_load is None:
            return None  # the first grant was guarded in `_refuse_new`
        return guard_refusal(self._intake_load(), more, self.limits)

    def _renew(self, m: IncomingMigration, msg: PreAlloc) -> None:
        m.expires_at = self._clock() + min(max(msg.lease_s, self.limits.watchdog_interval_s), self.limits.lease_s)

    def _refuse_new(self, msg: PreAlloc) -> str | None:
        if msg.stage != 0:
            return f"unknown migration {msg.migration_id} (stage {msg.stage})"
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        if self.num_active >= self.limits.max_in:
            return f"busy: {self.num_active} incoming migrations"
        if self._intake_load is not None:
            return guard_refusal(self._intake_load(), msg.num_blocks, self.limits)
        return None

    def handle_abort(self, msg: MigrationAbort) -> Ack:
        m = self._migrations.get(msg.migration_id)
        if m is None:  # never seen (or forgotten): remember it, so a late pre-alloc/commit fails
            m = self._migrations[msg.migration_id] = IncomingMigration(msg.migration_id, "", 0.0)
            m.abort(MigrationStatus.ABORTED_SRC, msg.reason or "aborted by the source", self._clock())
            return Ack(ok=True)
        if m.status is MigrationStatus.FINISHED:
            return Ack(ok=False, error=ALREADY_COMMITTED)
        if m.status is MigrationStatus.RUNNING:
            self._end(m, MigrationStatus.ABORTED_SRC, msg.reason or "aborted by the source")
        return Ack(ok=True)

    def abort_request(self, request_id: str) -> None:
        """The client aborted the request (broadcast): drop any migration of it into here."""
        for m in self.active():
            if m.request_id == request_id:
                self._end(m, MigrationStatus.ABORTED_SRC, "request aborted by the client")

    # -- lease watchdog ------------------------------------------------------------------------

    def expire(self) -> list[IncomingMigration]:
        """Free the leases whose source stopped renewing them; forget old tombstones."""
        now = self._clock()
        expired = [m for m in self.active() if m.expires_at < now and not m.writers]
        for m in expired:
            log.warning("incoming migration %s of %s: lease expired", m.migration_id, m.request_id)
            self._end(m, MigrationStatus.ABORTED_SRC, "lease expired")
        stale = [k for k, m in self._migrations.items() if m.ended_at is not None and now - m.ended_at > self.limits.tombstone_s]
        for key in stale:
            del self._migrations[key]
        return expired

    async def run_watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.limits.watchdog_interval_s)
            self.expire()

    def stop(self) -> None:
        for m in self.active():
            self._end(m, MigrationStatus.ABORTED_DST, "destination stopping")

    # -- FrameSink (KV receiver) ---------------------------------------------------------------

    def admit(self, header: FrameHeader) -> AckStatus:
        m = self._migrations.get(header.migration_id)
        if m is None or m.status.is_over:
            return AckStatus.UNKNOWN_MIGRATION
        if header.tokens:  # token positions: the next ones, within the lease
            end = header.lease_offset + header.num_blocks
            if header.lease_offset != m.filled_tokens or end > len(m.block_ids) * m.block_size:
                return AckStatus.BAD_RANGE
            if header.num_blocks and not self.copier.token_bytes:
                return AckStatus.BAD_SIZE  # (this layout has no token slots)
            if header.payload_len != self.copier.token_frame_bytes(header.num_blocks):
                return AckStatus.BAD_SIZE
            return AckStatus.OK
        if header.num_blocks and (header.lease_offset * m.block_size != m.filled_tokens
                                  or header.lease_offset + header.num_blocks > len(m.block_ids)):
            return AckStatus.BAD_RANGE  # (an empty frame, a commit's carrier, writes nothing anywhere)
        if header.payload_len != self.copier.frame_bytes(header.num_blocks):
            return AckStatus.BAD_SIZE
        return AckStatus.OK

    async def write(self, header: FrameHeader, payload: memoryview) -> AckStatus:
        status = self.admit(header)  # again: the checksum was an await
        if status is not AckStatus.OK:
            return status
        m = self._migrations[header.migration_id]
        start = header.lease_offset
        m.writers += 1
        try:
            if header.tokens:
                self.copier.scatter_tokens(m.block_ids, start, start + header.num_blocks, payload)
            else:
                await self.copier.scatter(m.block_ids[start : start + header.num_blocks], payload)
        except BaseException:
            self._unpin(m, header, landed=False)
            raise
        return self._unpin(m, header, landed=True)

    def open_frame(self, header: FrameHeader) -> list[memoryview] | AckStatus | None:
        """DirectFrameSink: lend the frame's lease blocks to the receiver (pinned like a
        scatter, by `writers`, until close_frame); None: not plain host memory, scatter it."""
        status = self.admit(header)
        if status is not AckStatus.OK:
            return status
        m = self._migrations[header.migration_id]
        start = header.lease_offset
        if header.tokens:  # a few slots: into a buffer of the lease, scattered at close_frame
            m.token_buffer = np.empty(header.payload_len, dtype=np.uint8)
            views = [memoryview(m.token_buffer)]
        else:
            views = self.copier.block_views(m.block_ids[start : start + header.num_blocks])
        if views is not None:
            m.writers += 1
        return views

    def close_frame(self, header: FrameHeader, ok: bool) -> AckStatus:
        m = self._migrations.get(header.migration_id)
        if m is None:
            return AckStatus.UNKNOWN_MIGRATION
        if header.tokens:
            buffer, m.token_buffer = m.token_buffer, None
            if ok and not m.status.is_over:  # (inline: a few slots, and the commit may follow)
                try:
                    self.copier.scatter_tokens(m.block_ids, header.lease_offset,
                                               header.lease_offset + header.num_blocks, buffer)
                except Exception:  # (admitted, so a bug: the frame fails, the lease is unpinned)
                    log.exception("token frame of migration %s failed", m.migration_id)
                    self._unpin(m, header, landed=False)
                    return AckStatus.FAILED
        return self._unpin(m, header, landed=ok)

    def _unpin(self, m: IncomingMigration, header: FrameHeader, landed: bool) -> AckStatus:
        """A frame's writer is done with the lease blocks (a release waiting on it may go now);
        count the frame if it landed whole and the migration still stands."""
        m.writers -= 1
        if m.release_pending and not m.writers:
            self._release(m)
        if m.status.is_over:
            return AckStatus.UNKNOWN_MIGRATION
        if landed:
            m.filled_tokens += header.num_blocks if header.tokens else header.num_blocks * m.block_size
            m.expires_at = max(m.expires_at, self._clock() + self.limits.lease_s)
        return AckStatus.OK

    def frame_failed(self, header: FrameHeader, status: AckStatus) -> None:
        m = self._migrations.get(header.migration_id)
        if m is not None and m.status is MigrationStatus.RUNNING:
            self._end(m, MigrationStatus.ABORTED_DST, f"KV frame {status.name.lower()}")

    # -- internals -----------------------------------------------------------------------------

    def _settle(self, m: IncomingMigration) -> None:
        if self.hold is not None:
            self.hold.settle(m.migration_id)

    def _end(self, m: IncomingMigration, status: MigrationStatus, reason: str) -> None:
        m.abort(status, reason, self._clock())
        self._settle(m)  # a step held for its commit goes now
        log.info("incoming migration %s of %s ended: %s (%s)", m.migration_id, m.request_id, status.value, reason)
        if m.writers:
            m.release_pending = True  # a scatter still writes into these blocks
        else:
            self._release(m)
        self._on_change()

    def _release(self, m: IncomingMigration) -> None:
        m.release_pending = False
        self.ops.release_reservation(m.migration_id)
