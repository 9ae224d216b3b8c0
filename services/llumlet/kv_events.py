"""What the engine's prefix cache holds, told to the schedulers: `KvCacheEvents` (the block hashes
stored and removed since the last message, numbered per instance from 1) and `KvCacheSnapshot`
(everything held, after event `seq`), from which `services.global_scheduler.prefix_tracker` keeps
the global prefix index.

- `services.llumlet.kv_journal.KvEventJournal` is what an engine writes to as its cache changes.
- `KvEventPublisher` sends the journal's changes every `interval_s` on the instance's events
  subject, a snapshot every `snapshot_interval_s` and whenever a scheduler asks (after a gap in
  the sequence, or on its start), so a lost message or a restarted scheduler resynchronises.
  A snapshot larger than one message is its first part, and the rest as stores numbered after it.
- While NATS is away nothing is taken from the journal (it merges the changes in place, at no
  cost per tick); a send that fails halfway puts the rest back. Snapshot requests that arrive
  before the snapshot they would start has begun share it (a scheduler's gap after a NATS blip
  is every scheduler's: one snapshot answers them all).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from shared import subjects
from services.llumlet.kv_journal import KvDelta, KvEventJournal
from shared.messages import HASHES_PER_MESSAGE, Ack, KvCacheEvents, KvCacheSnapshot, encode
from shared.nats_client import flush_in_order

log = logging.getLogger(__name__)

KV_EVENTS_INTERVAL_S = 0.05  # batching: a step's stores travel together, ~20 messages a second at most
KV_SNAPSHOT_INTERVAL_S = 10.0  # a lost message the scheduler did not notice (none followed) heals by then


class KvEventPublisher:
    def __init__(self, instance_id: str, block_size: int, journal: KvEventJournal, nc: Callable[[], Client | None],
                 interval_s: float = KV_EVENTS_INTERVAL_S, snapshot_interval_s: float = KV_SNAPSHOT_INTERVAL_S) -> None:
        self.instance_id = instance_id
        self.block_size = block_size
        self.journal = journal
        self._nc = nc
        self.interval_s = interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self.seq = 0  # of the last events message sent
        self._lock = asyncio.Lock()  # one sender at a time: seq order is send order
        self._next_snapshot: asyncio.Task[bool] | None = None  # asked for, not begun: later asks share it
        self._tasks: set[asyncio.Task] = set()

    async def subscribe(self, nc: Client) -> None:
        await nc.subscribe(subjects.llumlet(self.instance_id, "kv_snapshot"), cb=self._on_snapshot_request)
        await flush_in_order(nc)

    async def run(self) -> None:
        """Changes every `interval_s`; a snapshot every `snapshot_interval_s` (and one at once)."""
        loop = asyncio.get_running_loop()
        next_snapshot = loop.time()
        try:
            while True:
                if loop.time() >= next_snapshot:
                    await self.publish_snapshot()
                    next_snapshot = loop.time() + self.snapshot_interval_s
                else:
                    await self.publish_changes()
                await asyncio.sleep(self.interval_s)
        finally:  # (stopped with the llumlet: the asked snapshots go with it)
            for task in list(self._tasks):
                task.cancel()

    async def publish_changes(self) -> None:
        async with self._lock:
            if self._connected():  # (else the journal keeps merging them)
                await self._send_changes(self.journal.take())

    async def publish_snapshot(self) -> bool:
        """Pending changes first (their seq), then everything held after them; False if not sent."""
        async with self._lock:
            return await self._publish_snapshot_locked()

    async def _publish_snapshot_locked(self) -> bool:
        if not self._connected():
            return False  # NATS away: the journal keeps the changes, a snapshot follows them later
        delta, held = self.journal.take_with_snapshot()
        if not await self._send_changes(delta):
            return False
        # A cache past one message's worth (a large GPU's: ~100k blocks and more exceed NATS's
        # default 1 MiB payload) goes as a snapshot of the first part and the rest as stores
        # after it, numbered on: the index is whole once the last of them is in.
        first, rest = held[:HASHES_PER_MESSAGE], held[HASHES_PER_MESSAGE:]
        snapshot = KvCacheSnapshot(self.instance_id, self.seq, self.block_size, first)
        try:
            await self._nc().publish(subjects.kv_snapshot(self.instance_id), encode(snapshot))
        except NatsError as exc:
            log.warning("KV snapshot of %s (%d blocks) not sent: %s", self.instance_id, len(held), exc)
            return False
        return not rest or await self._send_changes(KvDelta(False, rest, []))

    async def _send_changes(self, delta: KvDelta) -> bool:
        """Send `delta`: False when NATS did not take it all (the rest is back in the journal)."""
        if delta.is_empty:
            return self._connected()
        if not self._connected():
            self.journal.put_back(delta)
            return False
        messages = list(_split(delta, HASHES_PER_MESSAGE))
        for i, part in enumerate(messages):
            events = KvCacheEvents(self.instance_id, self.seq + 1, self.block_size, part.stored, part.removed,
                                   part.cleared)
            try:
                await self._nc().publish(subjects.kv_events(self.instance_id), encode(events))
            except NatsError as exc:  # not sent: the rest goes back, for the same seq later
                log.debug("KV events of %s not sent: %s", self.instance_id, exc)
                self.journal.put_back(functools.reduce(_merge, messages[i:]))
                return False
            self.seq += 1
        return True

    def _connected(self) -> bool:
        nc = self._nc()
        return nc is not None and nc.is_connected

    async def _on_snapshot_request(self, msg: Msg) -> None:
        # Answered from a task: nats-py runs a subscription's callbacks one after another, so the
        # asks queued behind this one come in now and share the snapshot not yet begun.
        if self._next_snapshot is None:
            self._next_snapshot = self._spawn(self._asked_snapshot())
        self._spawn(self._answer(msg, self._next_snapshot))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _asked_snapshot(self) -> bool:
        async with self._lock:
            self._next_snapshot = None  # begun: an ask from now on needs one after it
            return await self._publish_snapshot_locked()  # to every scheduler: none is hurt by it

    async def _answer(self, msg: Msg, snapshot: asyncio.Task[bool]) -> None:
        sent = await asyncio.shield(snapshot)
        if msg.reply:
            try:
                await msg.respond(encode(Ack(ok=sent, error=None if sent else "snapshot not sent")))
            except NatsError as exc:
                log.debug("KV snapshot request of %s not answered: %s", self.instance_id, exc)


def _merge(first: KvDelta, then: KvDelta) -> KvDelta:
    if then.cleared:
        return then
    changes = {h: True for h in first.stored} | {h: False for h in first.removed}
    changes.update({h: True for h in then.stored} | {h: False for h in then.removed})
    return KvDelta(first.cleared, [h for h, held in changes.items() if held],
                   [h for h, held in changes.items() if not held])


def _split(delta: KvDelta, limit: int) -> Iterable[KvDelta]:
    """Messages of at most `limit` hashes, removals first (the lists are disjoint: any cut is safe)."""
    items = [(h, False) for h in delta.removed] + [(h, True) for h in delta.stored]
    if not items:
        yield delta
    for start in range(0, len(items), limit):
        part = items[start:start + limit]
        yield KvDelta(delta.cleared and start == 0, [h for h, held in part if held],
                      [h for h, held in part if not held])
