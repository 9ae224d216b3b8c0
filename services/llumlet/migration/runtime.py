"""Everything migration inside one llumlet, wired together: the block copier, the KV receiver,
the handshake (both sides), the source coordinator, the lease watchdog, and the engine loop's
side of it (`before_step` / `after_step`: the step clock, the hold for an imminent commit)."""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.llumlet.migration.commit_hold import CommitHold, StepClock
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.departures import Departures
from services.llumlet.migration.destination import IncomingMigrations
from services.llumlet.migration.handover import log_handover_step
from services.llumlet.migration.handshake import HandshakeServer, NatsDestinationLink
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.ops import MigratableEngine
from services.llumlet.migration.protocol import MigrationLimits
from services.llumlet.migration.source import MigrationCoordinator
from services.llumlet.migration.source_stages import SourceHooks
from shared import subjects
from shared.messages import (
    MAX_CANDIDATE_HASHES,
    MigrateOrder,
    MigrationCommit,
    decode_or_drop,
)

log = logging.getLogger(__name__)


class MigrationHooks(SourceHooks, Protocol):
    def refusal(self) -> str | None:
        """Why this instance takes no incoming migration now (e.g. draining), or None."""

    async def migrated_in(self, commit: MigrationCommit) -> None:
        """A request committed here: publish its output from now on."""


class LlumletMigration:
    """Built with the llumlet, started after its engine (the KV cache exists only then)."""

    def __init__(self, instance_id: str, ops: MigratableEngine, limits: MigrationLimits, hooks: MigrationHooks,
                 kv_host: str = "127.0.0.1", kv_port: int = 0, kv_advertise_host: str | None = None) -> None:
        self.instance_id = instance_id
        self.ops = ops
        self.limits = limits
        self.hooks = hooks
        self.kv_host, self.kv_port, self.kv_advertise_host = kv_host, kv_port, kv_advertise_host
        self.copier: BlockCopier | None = None
        self.incoming: IncomingMigrations | None = None
        self.receiver: KVReceiver | None = None
        self.senders = KVSenderPool(limits)
        self.coordinator: MigrationCoordinator | None = None
        self.departures = Departures()  # the source's return-trip limit reads what commits brought in
        self.steps = StepClock()
        self.hold = CommitHold(limits.hold_max_s, self.steps, step_share=limits.hold_step_share)
        self._handovers: dict[str, float] = {}  # committed here, its first step not begun: request id → when

    async def start(self, nc: Client) -> list[Coroutine[Any, Any, None]]:
        """Listen for KV frames and handshakes; returns the background loops to run."""
        self.copier = BlockCopier(self.ops.kv_regions(), initial_frame_bytes=self.limits.effective_frame_bytes())
        self.incoming = IncomingMigrations(self.ops, self.copier, self.limits, refusal=self.hooks.refusal,
                                           on_change=self.hooks.changed, intake_load=self.ops.intake_load,
                                           on_committed=self._migrated_in,
                                           hold=self.hold if self.hold.enabled else None)
        self.receiver = KVReceiver(self.incoming, self.limits, self.copier.new_host_buffer, self.kv_host,
                                   self.kv_port, self.kv_advertise_host)
        try:
            self.incoming.kv_address = await self.receiver.start()
        except OSError as exc:
            raise SystemExit(f"cannot listen for KV transfers on {self.kv_host}:{self.kv_port}: {exc}") from exc
        self.coordinator = MigrationCoordinator(self.instance_id, self.ops, self.copier,
                                                NatsDestinationLink(nc, self.limits), self.senders, self.limits,
                                                self.hooks, departures=self.departures, steps=self.steps)
        await HandshakeServer(self.incoming).subscribe(nc, self.instance_id)
        await nc.subscribe(subjects.llumlet(self.instance_id, "migrate"), cb=self._on_order)
        log.info("migration on: KV receiver at %s (%d bytes per block)", self.kv_address, self.copier.block_bytes)
        return [self.coordinator.run(), self.incoming.run_watchdog()]

    async def stop(self) -> None:
        if self.coordinator is not None:
            await self.coordinator.stop()
        if self.incoming is not None:
            self.incoming.stop()
        if self.receiver is not None:
            await self.receiver.close()
        self.senders.close()
        if self.copier is not None:
            self.copier.close()

    # -- the engine loop's side -----------------------------------------------------------------

    async def before_step(self) -> float:
        """Right before the engine loop starts a step: hold it for a commit due any moment (its
        request then joins this step), then stamp its start; returns that start (monotonic)."""
        await self.hold.wait()
        started = time.monotonic()
        self.steps.started(started)
        return started

    def after_step(self, started: float, ended: float) -> None:
        """The step that began at `started` ended: for each request committed here before it
        began (its first step here), log the other requests' token gap around it."""
        before, typical = self.steps.last_ended_at, self.steps.typical_s
        self.steps.ended(ended)
        for request_id, committed_at in list(self._handovers.items()):
            if committed_at <= started:
                del self._handovers[request_id]
                log_handover_step(log, request_id, before, started, ended, self.hold.last_held_s, typical)

    async def _migrated_in(self, commit: MigrationCommit) -> None:
        m = self.incoming.get(commit.migration_id) if self.incoming is not None else None
        committed_at = m.ended_at if m is not None and m.ended_at is not None else time.monotonic()
        self._handovers[commit.request.request_id] = committed_at
        self.departures.arrived(commit.request.request_id, commit.departures)
        await self.hooks.migrated_in(commit)

    async def _on_order(self, msg: Msg) -> None:
        order = decode_or_drop(msg.data, MigrateOrder, log, "migrate order", msg.subject)
        if order is None:
            return
        if self.coordinator is not None:
            self.coordinator.on_order(order)

    def on_request_aborted(self, request_id: str) -> None:
        if self.incoming is not None:
            self.incoming.abort_request(request_id)

    @property
    def kv_address(self) -> str:
        return self.incoming.kv_address if self.incoming is not None else ""

    @property
    def num_migrating(self) -> int:
        outgoing = self.coordinator.num_active if self.coordinator is not None else 0
        return outgoing + (self.incoming.num_active if self.incoming is not None else 0)

    @property
    def num_migrating_in(self) -> int:
        return self.incoming.num_active if self.incoming is not None else 0

    @property
    def num_migrations_asked_total(self) -> int:
        return self.incoming.num_asked_total if self.incoming is not None else 0

    @property
    def reserved_blocks(self) -> int:
        return self.ops.num_reserved_blocks()

    def candidate_hashes(self) -> list[int]:
        """For the load report: the prefix of the request this instance would move out next."""
        return self.coordinator.next_candidate_hashes(MAX_CANDIDATE_HASHES) if self.coordinator is not None else []
