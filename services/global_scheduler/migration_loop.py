"""Migration pairing, every round: pair sources with destinations from the live load table and
order each source to keep migrating to its destination.

The scheduler tracks pairs, never requests. A pair that still qualifies is re-confirmed every
round with the same pair id (orders are idempotent; the source lets a pair lapse if the
confirmations stop, e.g. when the scheduler dies); a pair that no longer qualifies is cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from shared import subjects
from shared.messages import LoadReport, MigrateOrder, encode
from shared.policy.config import PolicyConfig
from shared.policy.disaggregation import rebalancing_pairs
from shared.policy.migration import CachedPrefixOf, MigrationGuard
from shared.policy.prefix_dispatch import PrefixIndex

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]


@dataclass(frozen=True)
class Order:
    src: str
    message: MigrateOrder


class MigrationPairer:
    """Pure bookkeeping of standing pairs; `plan` turns one round's loads into orders."""

    def __init__(self, policy: PolicyConfig, guard: MigrationGuard, prefixes: PrefixIndex | None = None) -> None:
        self.policy = policy
        self.guard = guard
        # The llumlets' prefix caches: a source's next request goes preferably where its prefix is
        # (`CacheAffinity`, bounded); None, or reports without candidate hashes: freeness alone.
        self.prefixes = prefixes
        self.pairs: dict[str, MigrateOrder] = {}  # source → its standing order
        self._rounds = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]  # pair ids stay unique across scheduler restarts
        self._ids = itertools.count(1)

    def release(self) -> list[Order]:
        """Cancel every standing pair (this replica stops pairing: another leads now)."""
        orders = [Order(src, MigrateOrder(standing.pair_id, standing.dst_instance_id, cancel=True))
                  for src, standing in self.pairs.items()]
        self.pairs.clear()
        return orders

    def plan(self, loads: Sequence[LoadReport]) -> list[Order]:
        round_no = next(self._rounds)
        migratable = [load for load in loads if load.kv_address]  # (no KV receiver: migration is off there)
        # The policy's anti-thrash guard (no destination with a queue, a freeness gap), as the
        # simulator pairs, so the services pair exactly as `loadgen simulate` measured.
        # (none into a prefill instance: it hands its requests off, issue 19 §2)
        pairs = rebalancing_pairs(migratable, self.policy, self.guard, self._cached_prefix(migratable))
        wanted = {pair.src: pair.dst for pair in pairs}
        orders = []
        for src, standing in list(self.pairs.items()):
            if wanted.get(src) != standing.dst_instance_id:
                del self.pairs[src]
                orders.append(Order(src, MigrateOrder(standing.pair_id, standing.dst_instance_id, cancel=True, round=round_no)))
        for src, dst in wanted.items():
            standing = self.pairs.get(src)
            if standing is None:
                standing = self.pairs[src] = MigrateOrder(f"{self._prefix}-{next(self._ids)}", dst)
                log.info("pair %s: %s → %s", standing.pair_id, src, dst)
            orders.append(Order(src, MigrateOrder(standing.pair_id, dst, round=round_no)))
        return orders


    def _cached_prefix(self, loads: Sequence[LoadReport]) -> CachedPrefixOf | None:
        index = self.prefixes
        if index is None:
            return None
        hashes = {load.instance_id: load.migration_candidate_hashes for load in loads}
        return lambda src: index.matches(hashes[src]) if hashes.get(src) else {}


class MigrationLoop:
    """Runs the pairer every `interval_s` over the live loads and publishes its orders."""

    def __init__(self, pairer: MigrationPairer, live_loads: Callable[[], list[LoadReport]], publish: Publish,
                 interval_s: float, on_order: Callable[[MigrateOrder], None] | None = None,
                 leads: Callable[[], bool] = lambda: True) -> None:
        assert interval_s > 0, interval_s
        self.pairer = pairer
        self.live_loads = live_loads
        self.publish = publish
        self.interval_s = interval_s
        self.on_order = on_order
        self.leads = leads  # only the leading scheduler replica pairs (leadership.py)
        self.leading = False
        self.orders_sent = 0

    async def round(self) -> None:
        leads = self.leads()
        if leads != self.leading:
            log.info("this scheduler %s migration pairing", "leads" if leads else "no longer leads")
            self.leading = leads
            if not leads:
                await self._send(self.pairer.release())
        if leads:
            await self._send(self.pairer.plan(self.live_loads()))

    async def _send(self, orders: list[Order]) -> None:
        for order in orders:
            await self.publish(subjects.llumlet(order.src, "migrate"), encode(order.message))
            self.orders_sent += 1
            if self.on_order is not None:
                self.on_order(order.message)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.round()
            except Exception:  # (a NATS hiccup) the next round re-sends every standing order
                log.exception("migration round failed")
