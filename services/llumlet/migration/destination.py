"""Destination side of live migration: the registry of incoming migrations (their leases:
`leases.py`) and the commit that hands a migrated request to this instance's engine and llumlet.

The COMMIT comes in the last KV frame (`commit_frame`, answered in that frame's ack); over NATS
only when the source never got that ack, and both go through `commit` (idempotent: a repeat is
answered from the record). A source's `CommitNotice` (the commit is due in a moment) goes to the
`CommitHold`, which the engine loop waits on before a step; a commit or an end settles it. A NATS
COMMIT that finds the lease not yet filled is refused and ends the migration (the source then
resumes the request), so a frame that lands later is refused too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.llumlet.migration.commit_hold import CommitHold
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.kv_wire import AckStatus, FrameHeader
from services.llumlet.migration.leases import IncomingLeases, IncomingMigration
from services.llumlet.migration.ops import IntakeLoad, MigratableEngine
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from shared.engine_model.views import EngineError
from shared.messages import Ack, CommitNotice, MigrationCommit, WireError, decode

log = logging.getLogger(__name__)


class IncomingMigrations(IncomingLeases):
    """Registry of migrations into this instance: their leases and their commit; the whole
    `FrameSink` of its KV receiver."""

    def __init__(self, ops: MigratableEngine, copier: BlockCopier, limits: MigrationLimits,
                 refusal: Callable[[], str | None] = lambda: None,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 intake_load: Callable[[], IntakeLoad] | None = None,
                 on_committed: Callable[[MigrationCommit], Awaitable[None]] | None = None,
                 hold: CommitHold | None = None) -> None:
        super().__init__(ops, copier, limits, refusal, on_change, clock, intake_load, hold)
        self._on_committed = on_committed  # the llumlet publishes the request's output from now on

    def handle_notice(self, msg: CommitNotice) -> None:
        """The source's word that the migration's commit is due in `commit_in_s`: the engine loop
        may hold its next step for it. Only for a migration running here (a late notice of one
        that ended holds nothing)."""
        m = self._migrations.get(msg.migration_id)
        if (self.hold is not None and m is not None and m.status is MigrationStatus.RUNNING
                and self.hold.expect(m.migration_id, msg.commit_in_s, paced=msg.paced)):
            log.info("commit notice %s of %s at %.6f: due in %.2f ms", m.migration_id, m.request_id, time.monotonic(),
                     1e3 * msg.commit_in_s)

    def handle_commit(self, commit: MigrationCommit) -> tuple[Ack, bool]:
        """(reply, whether this call committed it): a repeated commit acks without adding twice."""
        m = self._migrations.get(commit.migration_id)
        if m is None:
            return Ack(ok=False, error=f"unknown migration {commit.migration_id}"), False
        if m.status is MigrationStatus.FINISHED:
            return Ack(ok=True), False
        if m.status.is_over:
            return Ack(ok=False, error=f"migration {m.status.value}: {m.reason}"), False
        problem = self._commit_problem(m, commit)
        started = self._clock()
        if problem is None:
            try:
                self.ops.add_migrated(commit, m.migration_id)
            except EngineError as exc:
                problem = str(exc)
        if problem is not None:
            self._end(m, MigrationStatus.ABORTED_DST, problem)
            return Ack(ok=False, error=problem), False
        m.finish(self._clock())
        self._settle(m)  # (the request is in the engine: a held step may go, with it)
        log.info("incoming migration %s of %s committed: %d blocks (add_migrated %.2f ms)", m.migration_id,
                 m.request_id, len(m.block_ids), 1e3 * (m.ended_at - started))
        self._on_change()
        return Ack(ok=True), True

    async def commit(self, commit: MigrationCommit) -> Ack:
        """A COMMIT, from a KV frame or NATS: decide (`handle_commit`), then hand the request
        to the llumlet. Idempotent: a repeat is acked from the record, nothing added twice."""
        reply, committed = self.handle_commit(commit)
        if committed and self.hold is not None:
            await asyncio.sleep(0)  # a step held for it starts first (with it); its catch-up goes out meanwhile
        if committed and self._on_committed is not None:
            try:
                await self._on_committed(commit)
            except Exception:  # committed all the same: the request runs here now
                log.exception("migration %s committed, but handing it over failed", commit.migration_id)
        return reply

    async def commit_frame(self, header: FrameHeader, raw: bytes, frame_status: AckStatus) -> tuple[AckStatus, str]:
        """CommitSink: the commit carried by the last KV frame. A failed frame ended the
        migration already (`frame_failed`), so it is a refusal, unless the migration had
        committed before (a repeat)."""
        m = self._migrations.get(header.migration_id)
        if frame_status is not AckStatus.OK:
            if m is not None and m.status is MigrationStatus.FINISHED:
                return AckStatus.COMMITTED, ""
            return frame_status, f"KV frame {frame_status.name.lower()}"
        try:
            commit = decode(raw, MigrationCommit)
        except WireError as exc:
            commit = None
            problem = str(exc)
        else:
            problem = None if commit.migration_id == header.migration_id else "commit for another migration"
        if problem is not None:
            if m is not None and m.status is MigrationStatus.RUNNING:
                self._end(m, MigrationStatus.ABORTED_DST, problem)
            return AckStatus.COMMIT_REFUSED, problem
        reply = await self.commit(commit)
        return (AckStatus.COMMITTED, "") if reply.ok else (AckStatus.COMMIT_REFUSED, reply.error or "refused")

    def _commit_problem(self, m: IncomingMigration, commit: MigrationCommit) -> str | None:
        if commit.request.request_id != m.request_id:
            return f"commit for request {commit.request.request_id}, lease is for {m.request_id}"
        if not m.kv_complete(commit.num_computed_tokens):
            return (f"KV incomplete: {m.filled_tokens} of {commit.num_computed_tokens} tokens written "
                    f"({m.filled} of {len(m.block_ids)} blocks)")
        return None
