"""The scheduler's global prefix index, kept from the llumlets' KV events (`shared.prefix_index`).

- Events apply in each instance's sequence order; a gap (a lost message, a restarted llumlet or
  scheduler) leaves the instance out of sync, and the tracker asks its llumlet for a snapshot
  (`llumlet(id, "kv_snapshot")`), again every `resync_retry_s` until one arrives.
- An instance with a load report but never heard of here (this scheduler just started, and the
  instance's cache has not changed since) is asked for a snapshot too; one whose llumlet does
  not answer that subject (no responders: its engine caches nothing) is asked again only after
  `no_cache_retry_s`.
- An instance whose events or snapshot would take it past the index's bound (twice the cache size
  of its load report: `GlobalPrefixIndex.bound`) is out of sync, and asked again only after
  `no_cache_retry_s` too: asking at once would be refused again (its periodic snapshot still comes).
- An instance gone from the load table is forgotten, and so is whatever the tracker kept of it.

Its metrics: the index's size, instances out of sync, events by outcome, snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared import subjects
from shared.messages import HASHES_PER_MESSAGE, KvCacheEvents, KvCacheSnapshot, LoadReport, decode_own_or_drop
from shared.nats_client import flush_in_order, request as nats_request
from shared.prefix_index import GlobalPrefixIndex

log = logging.getLogger(__name__)

SNAPSHOT_REQUEST_TIMEOUT_S = 2.0
RESYNC_RETRY_S = 1.0  # a snapshot asked for and not come (lost, or the llumlet slow): ask again
NO_CACHE_RETRY_S = 10.0  # a llumlet that did not answer: its engine may have started caching since
TICK_S = 0.25


class PrefixTracker:
    def __init__(self, live_instances: Callable[[], Iterable[str]], registry: CollectorRegistry,
                 resync_retry_s: float = RESYNC_RETRY_S, no_cache_retry_s: float = NO_CACHE_RETRY_S,
                 load_of: Callable[[str], LoadReport | None] | None = None) -> None:
        """`load_of`: an instance's latest load report, whose cache size bounds its entries."""
        self._live_instances = live_instances
        self._load_of = load_of
        self.index = GlobalPrefixIndex(self._capacity, snapshot_part=HASHES_PER_MESSAGE)
        self.resync_retry_s = resync_retry_s
        self.no_cache_retry_s = no_cache_retry_s
        self._nc: Client | None = None
        self._asked: dict[str, float] = {}  # instance -> when a snapshot was last asked (monotonic)
        # instance -> when its llumlet had no snapshot subject, or its cache was past the index's bound
        self._no_cache: dict[str, float] = {}
        self._requests: set[asyncio.Task] = set()
        self.events = Counter("corral:scheduler_kv_events", "KV-event messages from the llumlets, by outcome "
                              "(applied; gap: out of order, a snapshot asked for; skipped: waiting for that "
                              "snapshot; over_bound: past the index's bound for the instance, out of sync)",
                              ["outcome"], registry=registry)
        self.snapshots = Counter("corral:scheduler_kv_snapshots", "KV-cache snapshots applied", registry=registry)
        self.snapshot_requests = Counter("corral:scheduler_kv_snapshot_requests",
                                         "Snapshots asked of a llumlet (a gap, or an instance not yet heard)",
                                         registry=registry)
        for outcome in ("applied", "gap", "skipped", "over_bound"):
            self.events.labels(outcome)
        registry.register(_IndexCollector(self.index))

    async def start(self, nc: Client) -> None:
        self._nc = nc
        # One subscription for events and snapshots: one callback queue, so an instance's
        # messages are applied in the order it sent them (two would race each other).
        await nc.subscribe(subjects.KV_ALL, cb=self._on_message)
        await flush_in_order(nc)  # subscribed at the server before anything is asked of a llumlet

    async def run(self) -> None:
        """Forget the instances that left; ask for the snapshots still missing."""
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()

    def tick(self) -> None:
        live = set(self._live_instances())
        for instance_id in self.index.instances() - live:
            self.index.forget(instance_id)
        for instance_id in (self._asked.keys() | self._no_cache.keys()) - live:  # (some never were in the index)
            self._asked.pop(instance_id, None)
            self._no_cache.pop(instance_id, None)
        for instance_id in live:
            if not self.index.in_sync(instance_id):
                self._ask_snapshot(instance_id)

    async def stop(self) -> None:
        for task in list(self._requests):
            task.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)

    # -- messages ------------------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        if msg.subject.endswith(".events"):
            self._on_events(msg)
        elif msg.subject.endswith(".snapshot"):
            self._on_snapshot(msg)

    def _on_events(self, msg: Msg) -> None:
        events = decode_own_or_drop(msg.data, KvCacheEvents, log, "KV events", msg.subject,
                                    lambda e: subjects.kv_events(e.instance_id))
        if events is None:
            return
        waiting = events.instance_id in self.index.out_of_sync
        if self.index.apply(events):
            self.events.labels("applied").inc()
            return
        if not waiting and events.instance_id in self.index.over_bound:
            self.events.labels("over_bound").inc()
            self._over_bound(events.instance_id, f"{len(events.stored)} blocks stored")
        else:
            self.events.labels("skipped" if waiting else "gap").inc()
        self._ask_snapshot(events.instance_id)

    def _on_snapshot(self, msg: Msg) -> None:
        snapshot = decode_own_or_drop(msg.data, KvCacheSnapshot, log, "KV snapshot", msg.subject,
                                      lambda s: subjects.kv_snapshot(s.instance_id))
        if snapshot is None:
            return
        self._asked.pop(snapshot.instance_id, None)
        if not self.index.restore(snapshot):
            self._over_bound(snapshot.instance_id, f"a snapshot of {len(snapshot.block_hashes)} blocks")
            return
        self.snapshots.inc()
        self._no_cache.pop(snapshot.instance_id, None)

    # -- resynchronisation ---------------------------------------------------------------------

    def _capacity(self, instance_id: str) -> int | None:
        load = self._load_of(instance_id) if self._load_of is not None else None
        return None if load is None else load.num_blocks_total

    def _over_bound(self, instance_id: str, what: str) -> None:
        if instance_id not in self._no_cache:
            log.warning("KV cache of %s past the prefix index's bound of %d blocks (%s): out of sync",
                        instance_id, self.index.bound(instance_id), what)
        self._no_cache[instance_id] = time.monotonic()

    def _ask_snapshot(self, instance_id: str) -> None:
        now = time.monotonic()
        if now - self._asked.get(instance_id, float("-inf")) < self.resync_retry_s:
            return  # asked a moment ago: its answer is on the way
        if now - self._no_cache.get(instance_id, float("-inf")) < self.no_cache_retry_s:
            return
        if self._nc is None or not self._nc.is_connected:
            return
        self._asked[instance_id] = now
        self.snapshot_requests.inc()
        task = asyncio.create_task(self._request_snapshot(instance_id), name=f"kv-snapshot-{instance_id}")
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _request_snapshot(self, instance_id: str) -> None:
        """The snapshot itself comes on the instance's snapshot subject (to every scheduler)."""
        try:
            await nats_request(self._nc, subjects.llumlet(instance_id, "kv_snapshot"), b"", SNAPSHOT_REQUEST_TIMEOUT_S)
        except NoRespondersError:  # no prefix cache there (or gone): not worth asking every tick
            self._no_cache[instance_id] = time.monotonic()
        except (TimeoutError, NatsError) as exc:  # slow or NATS away: the next tick asks again
            log.debug("KV snapshot of %s not answered: %r", instance_id, exc)


class _IndexCollector(Collector):
    def __init__(self, index: GlobalPrefixIndex) -> None:
        self.index = index

    def collect(self):
        yield GaugeMetricFamily("corral:scheduler_prefix_index_blocks",
                                "Distinct KV block hashes the prefix index knows some instance to hold",
                                value=self.index.size)
        yield GaugeMetricFamily("corral:scheduler_prefix_index_out_of_sync",
                                "Instances whose KV events had a gap, waiting for a snapshot",
                                value=len(self.index.out_of_sync))
        yield GaugeMetricFamily("corral:scheduler_prefix_index_over_bound",
                                "Of them, instances whose events or snapshot went past the index's bound "
                                "(twice the cache their load report tells): not indexed until a snapshot within it",
                                value=len(self.index.over_bound))
        family = GaugeMetricFamily("corral:instance_prefix_cache_blocks",
                                   "KV blocks the prefix index holds for the instance", labels=["instance_id"])
        for instance_id in sorted(self.index.instances()):
            family.add_metric([instance_id], self.index.num_blocks(instance_id))
        yield family
