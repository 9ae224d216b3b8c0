"""The vLLM destination's wire hash -> digest map (`prefix_pins.CachedDigests`) against a fake
block pool, and the source's wire hashes of a request's vLLM block hashes; the llumlet's
migration counters. (The real engine: tests/vllm/test_vllm_migration_prefix.py.)"""

from __future__ import annotations

from services.llumlet.engines.vllm.prefix_pins import KV_CACHE_GROUP, CachedDigests, wire_hashes_of
from services.llumlet.metrics import LlumletMetrics
from services.llumlet.migration.outgoing import OutgoingMigration, StageRecord
from shared.prefix_hash import block_digests, block_hashes, wire_hash

TOKENS = list(range(3, 3 + 5 * 16))
DIGESTS = block_digests(TOKENS, 16)  # 5 chained blocks
WIRE = block_hashes(TOKENS, 16)


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


class FakePool:
    """What `CachedDigests` asks of vLLM's BlockPool: `get_cached_block(digest, groups)`."""

    def __init__(self) -> None:
        self.cached: dict[bytes, list[Block]] = {}

    def cache(self, digest: bytes, block_id: int) -> None:
        self.cached.setdefault(digest, []).append(Block(block_id))

    def evict(self, digest: bytes) -> None:
        self.cached[digest].pop(0)
        if not self.cached[digest]:
            del self.cached[digest]

    def get_cached_block(self, digest: bytes, groups: list[int]) -> list[Block] | None:
        assert groups == [KV_CACHE_GROUP]
        blocks = self.cached.get(digest)
        return [blocks[0]] if blocks else None


def cached(pool: FakePool, digests: CachedDigests, indices: range) -> None:
    for i in indices:
        pool.cache(DIGESTS[i], 100 + i)
    digests.stored([DIGESTS[i] for i in indices])


def test_the_longest_leading_run_of_cached_blocks_is_found():
    pool = FakePool()
    digests = CachedDigests(pool)
    cached(pool, digests, range(0, 3))
    cached(pool, digests, range(4, 5))  # block 3 missing: block 4 cannot be used
    assert [b.block_id for b in digests.cached_prefix(WIRE, 10)] == [100, 101, 102]
    assert [b.block_id for b in digests.cached_prefix(WIRE, 2)] == [100, 101]
    assert digests.cached_prefix(WIRE, 0) == []
    assert digests.cached_prefix([WIRE[0] ^ 1], 10) == []  # a hash nobody cached
    # The count a load report takes off a waiting request's prefill (its vLLM digests): the same run.
    assert [digests.num_leading_cached(DIGESTS, n) for n in (10, 2, 0, -1)] == [3, 2, 0, 0]


def test_removed_and_cleared_blocks_are_forgotten_but_a_duplicate_keeps_its_digest():
    pool = FakePool()
    digests = CachedDigests(pool)
    cached(pool, digests, range(0, 3))
    pool.cache(DIGESTS[1], 201)  # a second block with block 1's content (vLLM does not deduplicate)
    pool.evict(DIGESTS[1])
    digests.removed([DIGESTS[1]])
    assert [b.block_id for b in digests.cached_prefix(WIRE, 10)] == [100, 201, 102]
    pool.evict(DIGESTS[1])
    digests.removed([DIGESTS[1]])
    assert [b.block_id for b in digests.cached_prefix(WIRE, 10)] == [100]
    assert len(digests) == 2 and digests.num_leading_cached(DIGESTS, 10) == 1
    digests.cleared()
    assert len(digests) == 0 and digests.cached_prefix(WIRE, 10) == []
    assert digests.num_leading_cached(DIGESTS, 10) == 0


def test_a_stale_digest_is_a_miss_not_a_wrong_block():
    pool = FakePool()
    digests = CachedDigests(pool)
    cached(pool, digests, range(0, 2))
    pool.evict(DIGESTS[0])  # evicted, its removal event not seen yet
    assert digests.cached_prefix(WIRE, 10) == []


def test_integer_event_hashes_give_no_digests():
    pool = FakePool()
    digests = CachedDigests(pool)
    pool.cache(DIGESTS[0], 100)
    digests.stored([int.from_bytes(DIGESTS[0][-8:], "big")])  # vLLM's integer form: not reversible
    assert len(digests) == 0 and digests.cached_prefix(WIRE, 10) == []


def test_wire_hashes_of_extends_what_it_computed_before():
    known: list[int] = []
    assert wire_hashes_of(DIGESTS[:2], known) == WIRE[:2]
    assert wire_hashes_of(DIGESTS, known) is known and known == WIRE
    assert known == [wire_hash(d) for d in DIGESTS]


def test_outgoing_migration_counters():
    metrics = LlumletMetrics("m", "i-1")
    m = OutgoingMigration("mig-1", "r-1", "i-2", 0, cached_blocks=7)
    m.stages = [StageRecord(0, 3, 3072, 0.01, 0.001, False), StageRecord(1, 1, 1024, 0.001, 0.0, True)]
    metrics.outgoing_migration_ended(m)
    metrics.outgoing_migration_ended(OutgoingMigration("mig-2", "r-2", "i-2", 0))  # aborted before a stage

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "i-1"})

    assert value("corral:llumlet_migration_kv_bytes_sent_total") == 4096
    assert value("corral:llumlet_migration_blocks_sent_total") == 4
    assert value("corral:llumlet_migration_blocks_cached_total") == 7
