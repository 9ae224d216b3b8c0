"""Destination leases that start with pinned cached blocks (issue 18 §4), on vLLM's own BlockPool
(no model, no engine): the pin takes a reference on the cached blocks of a request's prefix found
by wire hash, the add caches only the lease's blocks after them (re-caching a pinned block would
trip vLLM's own assertion), and a release gives every reference back with the cached blocks still
cached; vLLM's KV events feed the digest map the pins are found by. (Two real llumlets:
test_vllm_migration_prefix.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.vllm

BLOCK = 4
TOKENS = list(range(10, 10 + 4 * BLOCK + 2))  # 4 full blocks and 2 tokens


@dataclass
class FakeRequest:
    """What BlockPool.cache_full_blocks reads of vLLM's Request (KV events off)."""

    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)


@pytest.fixture
def setup():
    from vllm.v1.core.block_pool import BlockPool

    from services.llumlet.engines.vllm.connector import MigrationState
    from services.llumlet.engines.vllm.leases import DestinationLeases
    from services.llumlet.engines.vllm.prefix_pins import CachedDigests
    from shared.prefix_hash import block_digests

    pool = BlockPool(16, enable_caching=True, hash_block_size=BLOCK)
    digests = block_digests(TOKENS, BLOCK)
    # An earlier request computed the first 3 blocks here and finished: cached, nobody holds them.
    earlier = FakeRequest("earlier", digests[:3])
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(earlier, blocks, 0, 3, BLOCK, 0)
    pool.free_blocks(reversed(blocks))
    cached = CachedDigests(pool)
    cached.stored(digests[:3])  # (the BlockStored event, with raw digests)
    state = MigrationState()
    return pool, DestinationLeases(pool, state, BLOCK), cached, state, digests, [b.block_id for b in blocks]


def test_a_lease_pins_the_cached_prefix_and_caches_only_the_rest_at_the_add(setup):
    from services.llumlet.engines.vllm.leases import pinned_blocks_match
    from services.llumlet.engines.vllm.state import MigratedLoad
    from shared.prefix_hash import wire_hash

    pool, leases, cached, state, digests, earlier_ids = setup
    free_before = pool.get_num_free_blocks()
    pinned = leases.pin("lease", cached.cached_prefix([wire_hash(d) for d in digests], 10))
    assert pinned == earlier_ids
    assert pool.get_num_free_blocks() == free_before - 3  # out of the free queue: not evictable
    assert leases.pin("lease", cached.cached_prefix([wire_hash(d) for d in digests], 10)) == []  # once only
    reserved = leases.reserve("lease", 2)  # block 3 (full) and the partial one, sent by the source

    migrated = FakeRequest("migrated-1", list(digests))
    leases.adopt("migrated-1", MigratedLoad("lease", len(TOKENS)), migrated)
    assert state.loads["migrated-1"].lease_block_ids == pinned + reserved
    assert [pool.get_cached_block(d, [0])[0].block_id for d in digests] == [*pinned, reserved[0]]
    assert pinned_blocks_match(pool, [pool.blocks[i] for i in pinned], migrated.block_hashes)
    assert not pinned_blocks_match(pool, [pool.blocks[i] for i in pinned], migrated.block_hashes[1:])

    leases.drop_adopted("migrated-1")  # (the request left before its first step)
    assert pool.get_num_free_blocks() == free_before
    assert all(pool.blocks[i].ref_cnt == 0 for i in pinned + reserved)
    assert pool.get_cached_block(digests[0], [0])[0].block_id == pinned[0]  # still cached


def test_a_released_lease_gives_its_pins_back_and_a_held_block_stays_held(setup):
    from shared.prefix_hash import wire_hash

    pool, leases, cached, state, digests, earlier_ids = setup
    running = pool.blocks[earlier_ids[0]]
    pool.touch([running])  # a running request holds block 0
    free_before = pool.get_num_free_blocks()
    assert leases.pin("lease", cached.cached_prefix([wire_hash(d) for d in digests], 2)) == earlier_ids[:2]
    assert running.ref_cnt == 2 and pool.get_num_free_blocks() == free_before - 1  # block 1 left the free queue
    assert leases.release("lease") == 2
    assert running.ref_cnt == 1 and pool.get_num_free_blocks() == free_before


def test_the_kv_event_publisher_feeds_the_journal_and_the_digest_map(setup):
    """vLLM's own event types, as the scheduler hands them over with raw digests."""
    from types import SimpleNamespace

    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from services.llumlet.engines.vllm.kv_events import JournalPublisher
    from services.llumlet.engines.vllm.prefix_pins import CachedDigests
    from services.llumlet.kv_journal import KvEventJournal
    from shared.prefix_hash import wire_hash

    pool, _, _, _, digests, earlier_ids = setup
    journal = KvEventJournal()
    cached = CachedDigests(pool)
    publisher = JournalPublisher(journal, cached)
    wire = [wire_hash(d) for d in digests]
    stored = BlockStored(digests[:3], None, TOKENS[:3 * BLOCK], BLOCK, None, "GPU", None)
    publisher.publish(SimpleNamespace(events=[stored]))
    assert journal.num_held == 3 and [b.block_id for b in cached.cached_prefix(wire, 10)] == earlier_ids
    pool.evict_blocks({earlier_ids[2]})  # block 2 leaves vLLM's cache
    publisher.publish(SimpleNamespace(events=[BlockRemoved([digests[2]], "GPU")]))
    assert journal.num_held == 2 and [b.block_id for b in cached.cached_prefix(wire, 10)] == earlier_ids[:2]
    publisher.publish(SimpleNamespace(events=[AllBlocksCleared()]))
    assert journal.num_held == 0 and len(cached) == 0


@pytest.mark.parametrize("named", ["another prompt's block", "one block three times", "more than the request has"])
def test_pins_that_are_not_the_requests_prefix_are_not_adopted(setup, named):
    """A source (buggy or hostile) names cached blocks that do not hold the migrating request's
    prefix: the add must not run on their KV, nor fail the engine (it was an assertion that
    ended the llumlet): the lease goes back and vLLM computes the request's KV itself."""
    from services.llumlet.engines.vllm.state import MigratedLoad
    from shared.prefix_hash import block_digests, wire_hash

    pool, leases, cached, state, digests, _ = setup
    other = block_digests(list(range(500, 500 + 2 * BLOCK)), BLOCK)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(FakeRequest("other", other), blocks, 0, 2, BLOCK, 0)
    pool.free_blocks(reversed(blocks))
    cached.stored(other)
    wire = {"another prompt's block": [wire_hash(digests[0]), wire_hash(other[1])],
            "one block three times": [wire_hash(digests[0])] * 3,
            "more than the request has": [wire_hash(d) for d in digests[:3]]}[named]
    migrating = FakeRequest("migrated-1", list(digests[:2]))  # (its own hashes: 2 full blocks so far)
    free_before = pool.get_num_free_blocks()
    assert leases.pin("lease", cached.cached_prefix(wire, 10))
    leases.reserve("lease", 1)
    assert not leases.adopt("migrated-1", MigratedLoad("lease", 2 * BLOCK + 1), migrating)
    assert "migrated-1" not in state.loads and not leases.is_adopted("migrated-1")  # computed, not loaded
    assert pool.get_num_free_blocks() == free_before and leases.release("lease") == 0  # nothing held


def test_a_removed_copy_of_a_block_another_still_caches_stays_held(setup):
    """vLLM does not deduplicate cached blocks: a second copy of a digest (a prompt recomputed
    where its last block could not be reused) outlives the first one's removal, and the journal
    (what the schedulers' index and every snapshot are built from) must keep the digest."""
    from types import SimpleNamespace

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from services.llumlet.engines.vllm.kv_events import JournalPublisher
    from services.llumlet.engines.vllm.prefix_pins import CachedDigests
    from services.llumlet.kv_journal import KvEventJournal
    from shared.prefix_hash import wire_hash

    pool, _, _, _, digests, earlier_ids = setup
    copy = pool.get_new_blocks(1)  # block 0 computed again by another request
    pool.cache_full_blocks(FakeRequest("again", digests[:1]), copy, 0, 1, BLOCK, 0)
    pool.free_blocks(copy)
    journal = KvEventJournal()
    publisher = JournalPublisher(journal, CachedDigests(pool))
    publisher.publish(SimpleNamespace(events=[BlockStored(digests[:3], None, TOKENS[:3 * BLOCK], BLOCK, None,
                                                          "GPU", None)]))
    pool.evict_blocks({earlier_ids[0]})  # the first copy goes; the second still caches block 0
    publisher.publish(SimpleNamespace(events=[BlockRemoved([digests[0]], "GPU")]))
    assert wire_hash(digests[0]) in journal._held and journal.num_held == 3  # (was dropped: 2)
    pool.evict_blocks({copy[0].block_id})
    publisher.publish(SimpleNamespace(events=[BlockRemoved([digests[0]], "GPU")]))
    assert wire_hash(digests[0]) not in journal._held and journal.num_held == 2
