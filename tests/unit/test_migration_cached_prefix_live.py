"""Live migration that knows the cache (issue 18 §4), on the sim engine with prefix caching: the
first PRE-ALLOC offers the request's block hashes, the destination pins the cached blocks of its
prefix and says how many it holds, the source sends only the blocks after them, and the request
continues on the destination bound to those blocks, its stream unchanged.

Source and destination coordinators with a real loopback KV data plane (migration_source_harness)."""

from __future__ import annotations

import asyncio

import msgspec

from services.llumlet.migration.protocol import DestinationSlow, MigrationLimits, MigrationStatus
from tests.unit.migration_helpers import BLOCK_SIZE, expected_tokens, gen
from tests.unit.migration_source_harness import make_harness  # noqa: F401 (fixture)

PROMPT = 200  # gen() prompts are 1..n: two requests of one length share every prompt token


def bytes_sent(m) -> int:
    return sum(s.num_bytes for s in m.stages)


async def test_the_destination_binds_to_its_cached_prefix_and_only_the_rest_is_sent(make_harness) -> None:
    h = await make_harness(enable_prefix_caching=True)
    await h.decoding("cold", prompt=PROMPT, max_tokens=60)
    cold = await h.coordinator.migrate("cold", "dst")
    assert cold.status is MigrationStatus.FINISHED, cold.reason
    assert cold.cached_blocks == 0  # nothing of it was on the destination
    await h.wait_finished("cold")  # its prompt blocks stay cached there, free to evict

    await h.decoding("warm", prompt=PROMPT, max_tokens=300)
    cache = h.dst.scheduler.prefix_cache
    hashes = h.src.scheduler.get("warm").block_hashes
    cached_ids = cache.longest_hit(hashes, len(hashes))
    assert len(cached_ids) == PROMPT // BLOCK_SIZE
    warm = await h.coordinator.migrate("warm", "dst")
    assert warm.status is MigrationStatus.FINISHED, warm.reason
    assert warm.cached_blocks == PROMPT // BLOCK_SIZE
    assert h.dst.block_ids_of("warm")[:warm.cached_blocks] == cached_ids  # bound to the cached blocks
    # Only what the destination lacked crossed: every computed token past the cached blocks.
    sent_tokens = warm.tokens_sent - warm.cached_blocks * BLOCK_SIZE
    assert sent_tokens > 0 and bytes_sent(warm) == sent_tokens * h.src.kv_pool.kv_bytes_per_token
    assert bytes_sent(warm) < bytes_sent(cold) / 3
    await h.wait_finished("warm")
    assert h.stream("warm") == expected_tokens(h.src, "warm", 300)
    assert h.stream("cold") == expected_tokens(h.src, "cold", 60)
    h.assert_blocks_back()


async def test_without_prefix_caching_every_block_is_sent(make_harness) -> None:
    h = await make_harness()
    for rid in ("a", "b"):
        await h.decoding(rid, prompt=PROMPT, max_tokens=60)
        m = await h.coordinator.migrate(rid, "dst")
        assert m.status is MigrationStatus.FINISHED and m.cached_blocks == 0
        assert sum(s.num_blocks for s in m.stages) == m.lease_blocks
        await h.wait_finished(rid)
    h.assert_blocks_back()


async def test_an_aborted_migration_gives_the_pinned_blocks_back(make_harness) -> None:
    h = await make_harness(enable_prefix_caching=True)
    h.dst.add_request(gen("seed", PROMPT, 2))
    async with asyncio.timeout(5):
        while h.dst.get_request("seed") is not None:
            await asyncio.sleep(0.001)
    await h.decoding("r", prompt=PROMPT, max_tokens=300)

    async def slow_after_the_first_grant(msg) -> None:
        if msg.stage > 0:
            raise DestinationSlow("slow")

    h.link.before["prealloc"] = slow_after_the_first_grant
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and m.cached_blocks == PROMPT // BLOCK_SIZE
    assert "abort" in h.link.calls
    async with asyncio.timeout(5):
        while h.dst.num_reserved_blocks() or h.dst.scheduler.block_manager.pinned_blocks():
            await asyncio.sleep(0.005)
    assert h.dst.scheduler.prefix_cache.num_evictable == h.dst.scheduler.prefix_cache.num_cached
    await h.wait_finished("r")  # it went on at the source
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_the_source_names_the_prefix_of_the_request_it_would_move_next(make_harness) -> None:
    h = await make_harness(MigrationLimits(min_residence_s=0.0), enable_prefix_caching=True)
    assert h.coordinator.next_candidate_hashes(256) == []  # nothing decoding
    await h.decoding("long", prompt=PROMPT, max_tokens=300)
    await h.decoding("short", prompt=40, max_tokens=300)
    hashes = list(h.src.scheduler.get("short").block_hashes)  # the selection rule: the shortest
    assert len(hashes) == 40 // BLOCK_SIZE
    assert h.coordinator.next_candidate_hashes(256) == hashes
    assert h.coordinator.next_candidate_hashes(3) == hashes[:3]


async def test_a_source_naming_another_prompts_blocks_gets_the_request_computed_again(make_harness) -> None:
    """A buggy or hostile source's first PRE-ALLOC names blocks the destination holds for another
    prompt: the destination pins them, finds at the commit that they are not the request's
    prefix, gives them back and computes the request's KV from its tokens (as vLLM's does); the
    stream goes on unchanged."""
    h = await make_harness(enable_prefix_caching=True)
    other = gen("other", PROMPT, 2)
    h.dst.add_request(msgspec.structs.replace(other, prompt_token_ids=[t + 1000 for t in other.prompt_token_ids]))
    async with asyncio.timeout(5):
        while h.dst.get_request("other") is not None:
            await asyncio.sleep(0.001)
    other_hashes = list(h.dst.scheduler.prefix_cache.held_hashes())
    await h.decoding("r", prompt=PROMPT + 32, max_tokens=300)
    own = list(h.src.scheduler.get("r").block_hashes)
    assert not set(other_hashes) & set(own)

    async def name_the_other_prompt(msg) -> None:
        if msg.stage == 0:
            msg.block_hashes = other_hashes

    h.link.before["prealloc"] = name_the_other_prompt
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert m.cached_blocks == len(other_hashes) > 0  # pinned as named
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    # computed here: its prompt's blocks are cached under its own hashes (adopted, the other
    # prompt's blocks would have stood for its first ones)
    assert len(h.dst.scheduler.prefix_cache.longest_hit(own, len(own))) == len(own)
    h.assert_blocks_back()
