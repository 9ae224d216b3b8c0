"""The migration handshake over NATS request/reply: the source's client (`NatsDestinationLink`)
and the destination's subscriptions (`HandshakeServer`). (The COMMIT travels in the last KV
frame, see `kv_wire.py`; over NATS only when that frame's ack never came back.)

Every request has its own timeout. "No responders" (nobody subscribes: the destination is gone)
and a timeout (it may be alive but slow) are different errors, and the coordinator treats them
differently (after an unanswered COMMIT only the second leaves the outcome in doubt).
"""

from __future__ import annotations

import logging
from typing import Protocol, TypeVar

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.llumlet.migration.destination import IncomingMigrations
from services.llumlet.migration.protocol import DestinationGone, DestinationSlow, MigrationLimits, PreAllocGrant
from shared import bus_guard, subjects
from shared.messages import Ack, CommitNotice, MigrationAbort, MigrationCommit, PreAlloc, WireError, decode, encode
from shared.nats_client import request as nats_request

log = logging.getLogger(__name__)

R = TypeVar("R")


class DestinationLink(Protocol):
    """The handshake as the source coordinator sees it (NATS in production, fakes in tests)."""

    async def prealloc(self, dst: str, msg: PreAlloc) -> PreAllocGrant: ...

    async def abort(self, dst: str, msg: MigrationAbort) -> Ack: ...

    async def commit(self, dst: str, msg: MigrationCommit) -> Ack: ...

    async def notice(self, dst: str, msg: CommitNotice) -> None:
        """Tell the destination its commit is due (no reply: a lost notice only costs its hold)."""


class NatsDestinationLink:
    def __init__(self, nc: Client, limits: MigrationLimits) -> None:
        self.nc = nc
        self.limits = limits

    async def prealloc(self, dst: str, msg: PreAlloc) -> PreAllocGrant:
        return await self._ask(dst, "prealloc", msg, PreAllocGrant, self.limits.prealloc_timeout_s)

    async def abort(self, dst: str, msg: MigrationAbort) -> Ack:
        return await self._ask(dst, "abort", msg, Ack, self.limits.abort_timeout_s)

    async def commit(self, dst: str, msg: MigrationCommit) -> Ack:
        return await self._ask(dst, "commit", msg, Ack, self.limits.commit_timeout_s)

    async def notice(self, dst: str, msg: CommitNotice) -> None:
        await self.nc.publish(subjects.migration(dst, "notice"), encode(msg))

    async def _ask(self, dst: str, verb: str, msg: msgspec.Struct, reply_type: type[R], timeout_s: float) -> R:
        try:
            reply = await nats_request(self.nc, subjects.migration(dst, verb), encode(msg), timeout_s)
        except NoRespondersError as exc:
            raise DestinationGone(f"{dst} does not answer {verb} (no responders)") from exc
        except NatsTimeoutError as exc:
            raise DestinationSlow(f"{dst} did not answer {verb} within {timeout_s:g} s") from exc
        try:
            return decode(reply.data, reply_type)
        except WireError as exc:
            raise DestinationGone(f"{dst} answered {verb} with garbage: {exc}") from exc


class HandshakeServer:
    """The destination's subjects; each handler decodes, decides and replies (the notice has no
    reply; a PRE-ALLOC may wait for the engine to reserve blocks; `IncomingMigrations` keeps its
    decisions apart)."""

    def __init__(self, incoming: IncomingMigrations) -> None:
        self.incoming = incoming  # (its `commit` hands a committed request to the llumlet)

    async def subscribe(self, nc: Client, instance_id: str) -> None:
        await nc.subscribe(subjects.migration(instance_id, "prealloc"), cb=self._on_prealloc)
        await nc.subscribe(subjects.migration(instance_id, "abort"), cb=self._on_abort)
        await nc.subscribe(subjects.migration(instance_id, "commit"), cb=self._on_commit)
        await nc.subscribe(subjects.migration(instance_id, "notice"), cb=self._on_notice)

    async def _on_prealloc(self, msg: Msg) -> None:
        try:
            reply = await self.incoming.handle_prealloc(decode(msg.data, PreAlloc))
        except WireError as exc:
            bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "pre-alloc")
            reply = PreAllocGrant(ok=False, reason=str(exc))
        await self._respond(msg, reply)

    async def _on_abort(self, msg: Msg) -> None:
        try:
            reply = self.incoming.handle_abort(decode(msg.data, MigrationAbort))
        except WireError as exc:
            bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "migration abort")
            reply = Ack(ok=False, error=str(exc))
        await self._respond(msg, reply)

    async def _on_notice(self, msg: Msg) -> None:
        try:
            self.incoming.handle_notice(decode(msg.data, CommitNotice))
        except WireError as exc:
            bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "commit notice")

    async def _on_commit(self, msg: Msg) -> None:
        try:
            commit = decode(msg.data, MigrationCommit)
        except WireError as exc:
            bus_guard.rejected(msg.subject, exc.reason, str(exc), log, "migration commit")
            await self._respond(msg, Ack(ok=False, error=str(exc)))
            return
        await self._respond(msg, await self.incoming.commit(commit))

    @staticmethod
    async def _respond(msg: Msg, reply: msgspec.Struct) -> None:
        if msg.reply:
            await msg.respond(encode(reply))
