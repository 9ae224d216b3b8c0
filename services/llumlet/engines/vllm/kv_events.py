"""vLLM's own KV-cache events, taken in process into the llumlet's `KvEventJournal`.

vLLM's block pool queues `BlockStored` / `BlockRemoved` / `AllBlocksCleared` when
`kv_events_config.enable_kv_cache_events` is on, and its scheduler hands each step's batch to its
`kv_event_publisher` (ZMQ in vLLM's server). vLLM validates the publisher's name against its own
two ("null", "zmq"), so the engine is built with "null" and `install` puts `JournalPublisher` in
its place on the scheduler (in process, the one object the step calls).

Hashes: with `prefix_caching_hash_algo="sha256_cbor"` vLLM's block hash is the digest
`shared.prefix_hash` computes, so the gateway's chain and these events name the same blocks.
vLLM sends it as an int of the digest's last 8 bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by
default) or as the raw digest; either becomes the 63-bit wire hash. `startup.py` asks for raw
digests (`RAW_DIGESTS_ENV`): a migration's destination needs them to find a block the source names
by its wire hash (`prefix_pins.CachedDigests`, fed here too). Only the engine's own cache
(medium GPU or unset: the CPU build says GPU too) counts: an offloading tier's blocks are not
where a request's prefill is skipped.
"""

from __future__ import annotations

from typing import Any

from services.llumlet.engines.vllm.prefix_pins import CachedDigests
from services.llumlet.kv_journal import KvEventJournal
from shared.prefix_hash import HASH_BITS, wire_hash

HASH_ALGO = "sha256_cbor"  # the gateway's chain (shared.prefix_hash)
_MASK = (1 << HASH_BITS) - 1
_OWN_MEDIA = (None, "GPU")
RAW_DIGESTS_ENV = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}  # (read by vLLM once its engine is up)


def kv_events_config() -> Any:
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="null")


def to_wire_hash(block_hash: int | bytes) -> int:
    return wire_hash(block_hash) if isinstance(block_hash, bytes) else block_hash & _MASK


class JournalPublisher:
    """vLLM's `EventPublisher` interface (`publish(batch)`, `shutdown()`), into a journal."""

    def __init__(self, journal: KvEventJournal, digests: CachedDigests | None = None) -> None:
        self.journal = journal
        self.digests = digests

    def publish(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.journal.cleared()
                if self.digests is not None:
                    self.digests.cleared()
            elif getattr(event, "medium", None) not in _OWN_MEDIA:
                continue
            elif isinstance(event, BlockStored):
                self.journal.stored(map(to_wire_hash, event.block_hashes))
                if self.digests is not None:
                    self.digests.stored(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                # vLLM does not deduplicate cached blocks (a prompt recomputed where the cache
                # could not be reused, say its last block): one copy's removal leaves the digest
                # cached by another, and the schedulers must go on hearing it is held here.
                digests = self.digests
                gone = [h for h in event.block_hashes if digests is None or not digests.still_cached(h)]
                self.journal.removed(map(to_wire_hash, gone))
                if digests is not None:
                    digests.removed(event.block_hashes)

    def shutdown(self) -> None:
        return None


def install(probe: Any) -> tuple[KvEventJournal, CachedDigests] | None:
    """Route the engine's KV events into a new journal and digest map (None when prefix caching
    is off: no block is ever cached, no event sent). `probe`: the driver's `SchedulerProbe`."""
    if not probe.prefix_caching:
        return None
    journal, digests = KvEventJournal(), CachedDigests(probe.block_pool)
    probe.set_kv_event_publisher(JournalPublisher(journal, digests))
    return journal, digests
