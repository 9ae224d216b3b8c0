"""A migration's destination binds the request to the cached blocks of its prefix (issue 18 §4):
the lease pins them (no copy, never evicted meanwhile), they lead the request's table at the
commit, and an aborted lease gives them back to the cache."""

from __future__ import annotations

from shared.engine_model.request import SimRequest
from tests.unit.test_prefix_cache import BS, make, request, run_until_done

PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks + 2


def warm_destination(num_blocks: int = 16):
    dst = make(num_blocks)
    dst.add_request(request("earlier", PROMPT))
    run_until_done(dst)
    assert dst.prefix_cache.num_cached == 2 and dst.prefix_cache.num_evictable == 2
    return dst


def moving(rid: str = "m", num_output: int = 3) -> SimRequest:
    """The request as a commit brings it: decoding, its KV all but the last token."""
    r = request(rid, PROMPT, max_tokens=8)
    r.num_output_tokens = num_output
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_the_lease_pins_the_cached_prefix_and_the_table_starts_with_it():
    dst = warm_destination()
    cached = dst.prefix_cache.longest_hit(moving().block_hashes, 2)
    free_before = dst.block_manager.num_free
    assert dst.pin_cached_prefix("lease", moving().block_hashes, max_blocks=12 // BS) == 2
    assert dst.block_manager.num_free == free_before - 2  # the evictable hits are held now
    assert dst.block_manager.reserve("lease", 2) is not None  # the rest: blocks 2 and 3
    dst.check_invariants()
    assert dst.add_migrated(moving(), "lease")
    assert dst.block_ids_of("m")[:2] == cached
    dst.check_invariants()
    run_until_done(dst)
    assert dst.prefix_cache.num_cached >= 2 and dst.block_manager.num_used == 0


def test_pinned_blocks_are_shared_with_a_running_request():
    dst = make(16)
    dst.add_request(request("running", PROMPT, max_tokens=50))
    dst.update_from_output(dst.schedule(0.0), 1.0)  # prefilled: both full blocks cached, held
    assert dst.pin_cached_prefix("lease", moving().block_hashes, max_blocks=3) == 2
    dst.check_invariants()
    dst.block_manager.reserve("lease", 2)
    dst.add_migrated(moving(), "lease")
    assert dst.block_ids_of("m")[:2] == dst.block_ids_of("running")[:2]
    dst.check_invariants()


def test_an_aborted_lease_gives_the_pinned_blocks_back_to_the_cache():
    dst = warm_destination()
    free_before = dst.block_manager.num_free
    dst.pin_cached_prefix("lease", moving().block_hashes, max_blocks=3)
    dst.block_manager.reserve("lease", 2)
    assert dst.release("lease") == 4
    assert dst.block_manager.num_free == free_before and dst.prefix_cache.num_evictable == 2
    dst.check_invariants()
    assert dst.release("lease") == 0  # idempotent


def test_pinned_blocks_are_never_evicted_while_the_migration_copies():
    dst = warm_destination(num_blocks=6)  # 2 cached + 4 plain free
    dst.pin_cached_prefix("lease", moving().block_hashes, max_blocks=3)
    assert dst.block_manager.num_free == 4
    dst.add_request(request("other", list(range(500, 516)), max_tokens=1))  # 4 blocks: takes every free one
    run_until_done(dst)
    assert dst.prefix_cache.longest_hit(moving().block_hashes, 3) == dst.block_manager.reserved_blocks("lease")
    dst.check_invariants()


def test_the_hit_is_bounded_by_the_sources_full_blocks_and_a_cold_cache_pins_nothing():
    dst = warm_destination()
    assert dst.pin_cached_prefix("one", moving().block_hashes, max_blocks=1) == 1
    cold = make(16)
    assert cold.pin_cached_prefix("lease", moving().block_hashes, max_blocks=3) == 0
    assert cold.block_manager.reserved_blocks("lease") == []
    no_cache = make(16, enable_prefix_caching=False)
    assert no_cache.pin_cached_prefix("lease", moving().block_hashes, max_blocks=3) == 0


def test_a_source_naming_another_prompts_blocks_gets_its_request_computed_again():
    """As vLLM's destination (`tests/vllm/test_vllm_lease_adoption.py`): the pins are checked
    against the request's own prefix hashes at the commit; where they differ, the lease goes back
    and the request queues to compute its KV from its tokens, its output so far kept."""
    dst = warm_destination()
    free_before = dst.block_manager.num_free
    other = request("other", list(range(700, 710)), max_tokens=8)  # (not PROMPT: its hashes differ)
    assert dst.pin_cached_prefix("lease", moving().block_hashes, max_blocks=2) == 2  # PROMPT's blocks
    dst.block_manager.reserve("lease", 2)
    foreign = moving("m")
    foreign.block_hashes = other.block_hashes  # what the commit says the request is
    assert not dst.add_migrated(foreign, "lease")
    assert dst.block_manager.num_free == free_before and dst.prefix_cache.num_evictable == 2  # lease back
    assert foreign.num_computed_tokens == 0 and foreign in list(dst.waiting) and foreign not in dst.running
    dst.check_invariants()
    run_until_done(dst)
    assert foreign.num_output_tokens == 8 and foreign.num_recomputed_tokens == 0
    assert dst.block_manager.num_used == 0
    dst.check_invariants()


def test_a_pin_longer_than_the_requests_prefix_is_refused_too():
    dst = warm_destination()
    assert dst.pin_cached_prefix("lease", moving().block_hashes, max_blocks=2) == 2
    dst.block_manager.reserve("lease", 2)
    short = moving("m")
    short.block_hashes = short.block_hashes[:1]
    assert not dst.add_migrated(short, "lease")
    assert short.num_computed_tokens == 0 and short in list(dst.waiting)
    dst.check_invariants()
