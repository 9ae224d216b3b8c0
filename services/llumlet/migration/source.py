"""Source side of live migration: the pair the global scheduler ordered, the loop that keeps
migrating requests to it, and how many migrations run at once.

The loop picks only decoding requests (`is_migratable`, in the engine adapters) that may move
by the policy's per-request limits (`may_move`, as the simulator): stayed `min_residence_s`
here since they arrived or migrated in, and did not leave the destination less than
`min_return_s` ago (their `Departures`, carried in each commit). A destination that refused
or failed a migration gets no new one for `refused_backoff_s`.

Elsewhere: the protocol for one migration, its stages, commit and abort (`source_stages.py`);
the record of one migration (`outgoing.py`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.llumlet.migration.commit_hold import StepClock
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.departures import Departures
from services.llumlet.migration.handshake import DestinationLink
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.ops import LivePhase, MigratableEngine
from services.llumlet.migration.outgoing import OutgoingMigration
from services.llumlet.migration.protocol import MigrationLimits, new_migration_id
from services.llumlet.migration.source_stages import SourceHooks, StageDriver
from shared.cancellation import wait_set
from shared.messages import MigrateOrder
from shared.policy.migration import may_move, select_request_to_migrate

log = logging.getLogger(__name__)

_HISTORY = 256  # ended migrations kept for stats and tests


@dataclass
class _Pair:
    pair_id: str
    dst: str
    expires_at: float
    backoff_until: float = 0.0


class MigrationCoordinator:
    """Takes the scheduler's orders and keeps up to `max_out` migrations to the paired
    destination in flight, each in a task of its own that the stage driver runs."""

    def __init__(self, instance_id: str, ops: MigratableEngine, copier: BlockCopier, link: DestinationLink,
                 senders: KVSenderPool, limits: MigrationLimits, hooks: SourceHooks,
                 clock: Callable[[], float] = time.monotonic, departures: Departures | None = None,
                 steps: StepClock | None = None) -> None:
        self.instance_id = instance_id
        self.ops = ops
        self.hooks = hooks
        self._clock = clock
        self.departures = departures if departures is not None else Departures()
        self.stages = StageDriver(instance_id, ops, copier, link, senders, limits, hooks, self.departures, steps,
                                  clock, stopping=lambda: self._stopping, on_refused=self._back_off)
        self.notices = self.stages.notices
        self._guard = limits.guard()
        self._pair: _Pair | None = None
        self._active: dict[str, OutgoingMigration] = {}  # by request id
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self.history: collections.deque[OutgoingMigration] = collections.deque(maxlen=_HISTORY)
        self.on_ended: Callable[[OutgoingMigration], None] | None = None  # (the llumlet's metrics)

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

    @property
    def limits(self) -> MigrationLimits:
        """One set for the loop and the stages (a benchmark swaps them around one migration)."""
        return self.stages.limits

    @limits.setter
    def limits(self, limits: MigrationLimits) -> None:
        self.stages.limits = limits

    # -- the loop that keeps migrating while we are a source ----------------------------------

    async def run(self) -> None:
        while True:
            request_id, dst = self._next_migration()
            if request_id is None:
                self._wake.clear()
                # With a pair, look again soon (requests start decoding, the pair lapses);
                # without one, only an order (or a migration ending) wakes us.
                timeout_s = self.limits.idle_poll_s if self._pair is not None else None
                await wait_set(self._wake, timeout_s)
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
        candidates = [c for c in self.ops.migration_candidates()
                      if c.request_id not in self._active and self._may_move(c.request_id, dst)]
        choice = select_request_to_migrate(candidates)
        return (choice.request_id, dst) if choice is not None else (None, "")

    def next_candidate_hashes(self, limit: int) -> list[int]:
        """The leading block hashes of the request this source would move next by the selection
        rule (the residence guard left out: a request it holds back moves within a second), for
        the scheduler's pairing to match against the destinations' caches."""
        candidates = [c for c in self.ops.migration_candidates() if c.request_id not in self._active]
        choice = select_request_to_migrate(candidates)
        return [] if choice is None else list(self.ops.prefix_block_hashes(choice.request_id)[:limit])

    def _may_move(self, request_id: str, dst: str) -> bool:
        """The per-request limits the simulator runs (`may_move`): a request that just arrived or
        migrated in stays a while, and does not go back soon to an instance it left."""
        residence = self.ops.residence_s(request_id)
        return residence is not None and may_move(
            residence_s=residence, left_destination_s_ago=self.departures.left_s_ago(request_id, dst),
            guard=self._guard)

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

    async def migrate(self, request_id: str, dst: str, suspended: bool = False) -> OutgoingMigration | None:
        """Migrate one running request to `dst` and return how it ended; None if it is not
        running here. The migration runs in a task of ours, so `stop()` aborts it too.

        `suspended`: the caller took it out of the batch already (a prefill instance's hand-off,
        right after its first token): one stage, its whole KV; a failure resumes it here."""
        m = self._begin(request_id, dst, suspended)
        if m is not None:
            await asyncio.wait([self._spawn(m)])
        return m

    def _begin(self, request_id: str, dst: str, suspended: bool = False) -> OutgoingMigration | None:
        snapshot = self.ops.migration_snapshot(request_id)
        phase = LivePhase.SUSPENDED if suspended else LivePhase.RUNNING
        if snapshot is None or snapshot.phase is not phase or request_id in self._active:
            return None
        m = OutgoingMigration(new_migration_id(), request_id, dst, snapshot.num_preemptions, started_at=self._clock())
        if suspended:
            m.suspended_at = m.started_at
        self._active[request_id] = m
        self.hooks.changed()
        return m

    async def _drive(self, m: OutgoingMigration) -> None:
        try:
            await self.stages.drive(m)
        finally:
            del self._active[m.request_id]
            self.history.append(m)
            if self.on_ended is not None:
                self.on_ended(m)
            self.hooks.changed()

    def _back_off(self, dst: str) -> None:
        """A migration to `dst` ended ABORTED_DST: start none to it for a while (if still our pair)."""
        if self._pair is not None and self._pair.dst == dst:
            self._pair.backoff_until = self._clock() + self.limits.refused_backoff_s
