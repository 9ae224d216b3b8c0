"""The source's protocol for one migration: live stages while the request keeps decoding, the
suspend, the last stage with the COMMIT in its last frame, and the abort that resumes the request
here.

The request stays untouched on the source until the destination has committed: every stage
re-checks it after every await (finished, aborted, preempted, stopping → ABORT to the
destination, the request goes on here), and only the last stage takes it out of the batch.

Where the destination holds its next step for an imminent commit (its grants say so), the source
tells it first (`commit_notice.py`), then asks for the suspend.

Elsewhere: which request moves where, and how many at once (`source.py`); the record of one
migration (`outgoing.py`); learning the COMMIT's outcome when the last frame's ack is lost
(`commit_outcome.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from services.llumlet.migration.commit_hold import StepClock
from services.llumlet.migration.commit_notice import CommitNotifier
from services.llumlet.migration.commit_outcome import ask_commit, tell_abort
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.departures import Departures
from services.llumlet.migration.handshake import DestinationLink
from services.llumlet.migration.kv_plan import StagePlan, plan_tokens
from services.llumlet.migration.kv_sender import KVSenderPool, StageTransfer
from services.llumlet.migration.ops import LivePhase, MigratableEngine, MigrationSnapshot
from services.llumlet.migration.outgoing import OutgoingMigration, StageRecord
from services.llumlet.migration.protocol import (
    ALREADY_COMMITTED,
    CommitOutcomeUnknown,
    DestinationGone,
    DestinationRefused,
    MigrationFailed,
    MigrationLimits,
    MigrationStatus,
    SourceAborted,
)
from shared.messages import MAX_PREALLOC_HASHES, PreAlloc, encode
from shared.policy.migration import next_stage

log = logging.getLogger(__name__)


class SourceHooks(Protocol):
    """What the source side needs from its llumlet."""

    def migrated_out(self, request_id: str) -> None:
        """The destination committed: stop publishing for the request (before it is released)."""

    def resumed(self) -> None:
        """A suspended request is back in the batch: wake the engine loop."""

    def changed(self) -> None:
        """Migration state changed: publish a load report soon."""

    async def fail_request(self, request_id: str, reason: str) -> None:
        """The request cannot go on anywhere we know of: end it with an error to the client."""


class StageDriver:
    """Runs migrations through the protocol, one `drive` call each; what a migration has done
    so far lives in its `OutgoingMigration`, not here."""

    def __init__(self, instance_id: str, ops: MigratableEngine, copier: BlockCopier, link: DestinationLink,
                 senders: KVSenderPool, limits: MigrationLimits, hooks: SourceHooks, departures: Departures,
                 steps: StepClock | None, clock: Callable[[], float], *, stopping: Callable[[], bool],
                 on_refused: Callable[[str], None]) -> None:
        self.instance_id = instance_id
        self.ops = ops
        self.copier = copier
        self.link = link
        self.senders = senders
        self.limits = limits
        self.hooks = hooks
        self.departures = departures
        self._clock = clock
        self.notices = CommitNotifier(ops, link, steps, clock, limits.notice_steps)  # (where the destination holds)
        self._stopping = stopping  # the source is stopping: every check fails
        self._on_refused = on_refused  # (the destination's id) it refused or failed: back off from it
        # Blocks not yet full go by token slot where the layout has them (host memory) and the
        # limits allow it (the receiving side takes both whatever its own setting).
        self._by_token = copier is not None and bool(copier.token_bytes) and limits.token_frames

    async def drive(self, m: OutgoingMigration) -> None:
        """Run `m` to its end: committed (released here) or aborted (resumed here)."""
        try:
            await self._run_stages(m)
        except MigrationFailed as exc:
            await self._abort(m, exc)
        except asyncio.CancelledError:
            if not m.status.is_over:
                await self._abort(m, SourceAborted("source stopping"), in_doubt=m.commit_sent)
            raise
        except Exception as exc:  # a bug: still, the request must run on exactly one instance
            if m.committed_at is None:
                # (resumes it here, unless a COMMIT it may have sent did land)
                await self._abort(m, SourceAborted(f"internal error: {exc!r}"), in_doubt=m.commit_sent)
            elif not m.status.is_over:
                m.finish(self._clock())  # it runs on the destination
            raise

    async def _run_stages(self, m: OutgoingMigration) -> None:
        """Live stages while the request keeps decoding, then the last one with it suspended,
        and the COMMIT.

        A stage's PRE-ALLOC reserves all the request's blocks so far, the partial last one
        included. The last stage's PRE-ALLOC still goes out while the request runs: once few
        blocks remain it then usually reserves nothing, and the downtime is only the last copy
        with the COMMIT (a request that started a block meanwhile gets the stage topped up once
        suspended). When the stage limit forces the last stage (a blocking copy: stage limit 1),
        that PRE-ALLOC reserves what the request outgrew the copies by, also before the suspend:
        a reservation on vLLM waits for the destination's engine step in flight (2-5 ms), which
        would otherwise sit in the downtime.

        Where the KV layout moves single token slots (`BlockCopier.token_bytes`: host memory) and
        `limits.token_frames` allows it, a stage sends every token computed so far, the slots of
        a block not yet full by token (token frames): the last stage then sends only the tokens
        computed since the previous one, not the whole blocks they fall in. Stages are decided
        in blocks as before.

        A request its llumlet suspended before (a hand-off) has only the last stage."""
        if m.suspended_at is not None:
            snapshot = self._check(m, LivePhase.SUSPENDED)
            upto = snapshot.num_blocks
            prealloc_s = await self._prealloc(m, upto, snapshot.num_computed_tokens // self.ops.block_size)
            self._check(m, LivePhase.SUSPENDED)
            await self._last_stage(m, upto, snapshot.num_computed_tokens, prealloc_s)
            return
        block_size, rule = self.ops.block_size, self.limits.stage_rule()
        while True:
            snapshot = self._check(m, LivePhase.RUNNING)
            full = snapshot.num_computed_tokens // block_size  # blocks whose content is final
            num_blocks = next_stage(rule, m.stage, full, m.blocks_sent)  # (the simulator's rule too)
            if num_blocks is None:
                break
            prealloc_s = await self._prealloc(m, snapshot.num_blocks, full)
            self._check(m, LivePhase.RUNNING)
            await self._copy(m, full, snapshot.num_computed_tokens, prealloc_s)
        await self._prealloc(m, snapshot.num_blocks, full)  # (off the downtime)
        self._check(m, LivePhase.RUNNING)
        if await self.notices.notice(m, lambda: self._check(m, LivePhase.RUNNING)):
            # A step of ours just started: the blocks the request holds now are all it will hold
            # once suspended after it. One it took for this step is reserved now, while it still
            # decodes, not by a top-up in the downtime (~1 ms, the hold waiting on it).
            snapshot = self._check(m, LivePhase.RUNNING)
            if snapshot.num_blocks > m.lease_blocks:
                await self._prealloc(m, snapshot.num_blocks)
                self._check(m, LivePhase.RUNNING)
        await self._suspend(m)
        suspended = self._check(m, LivePhase.SUSPENDED)
        upto = suspended.num_blocks  # everything, the partial block too
        if upto < m.lease_blocks:
            raise SourceAborted(f"request holds {upto} blocks, fewer than the {m.lease_blocks} reserved")
        prealloc_s = 0.0
        if upto > m.lease_blocks:
            prealloc_s = await self._prealloc(m, upto)
            self._check(m, LivePhase.SUSPENDED)
        await self._last_stage(m, upto, suspended.num_computed_tokens, prealloc_s)

    async def _suspend(self, m: OutgoingMigration) -> None:
        asked = self._clock()
        if not await self.ops.suspend(m.request_id):
            raise SourceAborted("request left the batch before the last stage")
        m.suspended_at = self._clock()
        m.suspend_s = m.suspended_at - asked
        # The step waited for gave the request its last token here, and the engine loop has
        # published it (it ran before us): one turn of the event loop lets NATS write it out
        # before the last stage takes the loop, so the client does not get it a copy later.
        await asyncio.sleep(0)

    async def _copy(self, m: OutgoingMigration, upto: int, computed: int, prealloc_s: float) -> None:
        """A live stage: request blocks [blocks_sent, upto) into lease blocks of the same indices
        (with token slots: every position up to `computed`, whose KV is final)."""
        assert upto <= m.lease_blocks, (upto, m.lease_blocks)
        plan = self._pending(m, computed) if self._by_token else StagePlan(
            None, m.blocks_sent, self.ops.block_ids_of(m.request_id)[m.blocks_sent : upto], None)
        started = self._clock()
        transfer = StageTransfer(0, 0, 0, 0.0)
        if not plan.is_empty:
            transfer = await self._send(m, plan, LivePhase.RUNNING)
            self._check(m, LivePhase.RUNNING)
        m.stages.append(StageRecord(m.stage, upto - m.blocks_sent, transfer.num_bytes, self._clock() - started,
                                    prealloc_s, False, plan.num_tokens))
        m.blocks_sent = upto
        m.tokens_sent = computed if self._by_token else upto * self.ops.block_size
        m.stage += 1
        m.stage_lease_start = m.lease_blocks

    async def _send(self, m: OutgoingMigration, plan: StagePlan, phase: LivePhase,
                    commit: bytes = b"") -> StageTransfer:
        return await self.senders.send_stage(m.kv_address, m.migration_id, m.stage, plan.first_block, plan.block_ids,
                                             self.copier, lambda: self._check(m, phase), commit, plan.tail, plan.head)

    def _pending(self, m: OutgoingMigration, stop: int) -> StagePlan:
        """What sends token positions [tokens_sent, stop), where the layout moves token slots."""
        assert self._by_token and self.ops.block_size == self.copier.block_size, (self.ops.block_size,
                                                                                 self.copier.block_size)
        return plan_tokens(self.ops.block_ids_of(m.request_id), m.tokens_sent, stop, self.ops.block_size)

    async def _prealloc(self, m: OutgoingMigration, upto: int, full: int = 0) -> float:
        """Reserve lease blocks up to `upto` for this stage (again within a stage: a top-up);
        returns the seconds the round trip took. The first one offers the hashes of the
        request's `full` (computed) prompt blocks: the destination may hold some already."""
        num_blocks = upto - m.stage_lease_start  # the stage's blocks in all
        first = m.lease_blocks == 0 and m.stage == 0
        hashes = list(self.ops.prefix_block_hashes(m.request_id)[:min(full, MAX_PREALLOC_HASHES)]) if first else []
        msg = PreAlloc(m.migration_id, m.request_id, num_blocks, self.limits.lease_s, m.stage, hashes)
        asked = self._clock()
        grant = await self.link.prealloc(m.dst, msg)
        if not grant.ok:
            raise DestinationRefused(f"pre-alloc refused: {grant.reason}")
        if len(grant.block_ids) != num_blocks or not grant.kv_address:
            raise DestinationRefused(f"bad pre-alloc grant ({len(grant.block_ids)} of {num_blocks} blocks)")
        if first and grant.num_cached_blocks:
            if grant.num_cached_blocks > len(hashes):
                raise DestinationRefused(f"bad pre-alloc grant ({grant.num_cached_blocks} cached of {len(hashes)})")
            m.blocks_sent = m.cached_blocks = grant.num_cached_blocks  # there already: never sent
            m.tokens_sent = m.blocks_sent * self.ops.block_size
        m.lease_blocks = upto
        m.kv_address = grant.kv_address
        m.dst_hold_max_s = grant.hold_max_s
        return self._clock() - asked

    def _check(self, m: OutgoingMigration, phase: LivePhase) -> MigrationSnapshot:
        """After every await: is the request still where the migration left it?"""
        if self._stopping():
            raise SourceAborted("source stopping")
        snapshot = self.ops.migration_snapshot(m.request_id)
        if snapshot is None:
            raise SourceAborted("request finished or was aborted")
        if snapshot.num_preemptions != m.num_preemptions:
            raise SourceAborted("request was preempted")
        if snapshot.phase is not phase:
            raise SourceAborted(f"request is {snapshot.phase.value}, expected {phase.value}")
        return snapshot

    # -- the last stage, commit and abort ----------------------------------------------------------

    async def _last_stage(self, m: OutgoingMigration, upto: int, num_computed_tokens: int, prealloc_s: float) -> None:
        """Copy the rest (every computed token, the request holding `upto` blocks) with the
        COMMIT in the last frame; that frame's ack answers it (the downtime holds one TCP round
        trip, no NATS hop). Only when that ack is lost does the NATS COMMIT (idempotent) learn
        the outcome; a refusal raises (→ abort, resumes here)."""
        commit = self.ops.migration_commit(m.request_id, m.migration_id)
        commit.departures = self.departures.leaving(m.request_id, self.instance_id)
        commit.source_instance_id = self.instance_id
        assert upto <= m.lease_blocks, (upto, m.lease_blocks)
        if self._by_token:
            plan = self._pending(m, max(m.tokens_sent, num_computed_tokens))
        else:  # whole blocks, the partial last one included
            plan = StagePlan(None, m.blocks_sent, self.ops.block_ids_of(m.request_id)[m.blocks_sent : upto], None)
        raw = encode(commit)
        asked = m.commit_sent_at = self._clock()
        m.commit_via, m.commit_sent = "frame", True
        try:
            transfer = await self._send(m, plan, LivePhase.SUSPENDED, raw)
            committed: bool | None = transfer.committed
            num_bytes = transfer.num_bytes
        except CommitOutcomeUnknown as exc:
            log.warning("migration %s: %s; asking over NATS", m.migration_id, exc)
            m.commit_via = "frame+nats"
            committed = await ask_commit(self.link, self.limits, m.dst, commit, self._clock)
            num_bytes = self.copier.frame_bytes(len(plan.block_ids)) + self.copier.token_frame_bytes(plan.num_tokens)
        now = self._clock()
        # No re-check here: once committed, the request is the destination's whatever happens.
        m.stages.append(StageRecord(m.stage, upto - m.blocks_sent, num_bytes, now - asked, prealloc_s, True,
                                    plan.num_tokens))
        m.blocks_sent = upto
        m.tokens_sent = max(m.tokens_sent, num_computed_tokens)
        m.stage += 1
        await self._committed(m, committed, asked)

    async def _committed(self, m: OutgoingMigration, committed: bool | None, asked: float) -> None:
        """The COMMIT's outcome: True (runs there now: release it here), None (unknown: fail it)."""
        now = self._clock()
        m.commit_s = now - asked
        if committed:
            m.committed_at = now
            self.notices.committed(m, now)
            self.departures.forget(m.request_id)
            self.hooks.migrated_out(m.request_id)  # no await since the ack: nothing published meanwhile
        if committed is None:  # nobody knows: the request cannot go on anywhere for sure
            m.abort(MigrationStatus.ABORTED_DST, "commit outcome unknown", self._clock())
            await self.hooks.fail_request(m.request_id, "migration outcome unknown")
            return
        await self.ops.release_migrated(m.request_id)  # (False if the client aborted it meanwhile)
        m.release_s = self._clock() - now
        m.finish(self._clock())
        log.info("migrated %s to %s in %d stages (downtime %.1f ms), commit via %s; KV: %d of %d blocks sent "
                 "(%d bytes for %d tokens), %d cached there", m.request_id, m.dst, m.stage,
                 1e3 * (m.downtime_s or 0.0), m.commit_via, m.lease_blocks - m.cached_blocks, m.lease_blocks,
                 sum(s.num_bytes for s in m.stages), m.tokens_sent - m.cached_blocks * self.ops.block_size,
                 m.cached_blocks)

    async def _abort(self, m: OutgoingMigration, exc: MigrationFailed, in_doubt: bool = False) -> None:
        """End the migration here: the request resumes on the source, the destination gets an
        ABORT. `in_doubt`: a COMMIT may have landed (cancelled or failed while it was in
        flight), so the ABORT goes first and decides (answered "already committed": the request
        runs there, and is released here instead)."""
        if in_doubt:
            answer = await self._tell_abort(m, exc)
            if answer == ALREADY_COMMITTED:
                log.warning("migration %s: %s, but the destination had committed", m.migration_id, exc)
                await self._committed(m, True, self._clock())
                return
        m.abort(exc.status, str(exc), self._clock())
        log.info("migration of %s to %s aborted (%s): %s", m.request_id, m.dst, m.status.value, exc)
        snapshot = self.ops.migration_snapshot(m.request_id)
        if snapshot is not None and snapshot.phase is LivePhase.SUSPENDED and await self.ops.resume(m.request_id):
            self.hooks.resumed()  # the request goes on here as if nothing happened
        if m.status is MigrationStatus.ABORTED_DST:
            self._on_refused(m.dst)
        if isinstance(exc, DestinationGone) or in_doubt:
            return  # nobody there to release anything (or told already)
        await self._tell_abort(m, exc)

    async def _tell_abort(self, m: OutgoingMigration, exc: MigrationFailed) -> str | None:
        return await tell_abort(self.link, m.dst, m.migration_id, str(exc))
