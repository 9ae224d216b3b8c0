"""The simulated engine's prefix cache, with vLLM v1's semantics, and the block-manager
invariants around it."""

from __future__ import annotations

import random

from shared.engine_model.block_manager import BlockManager
from shared.engine_model.config import SchedulerConfig
from shared.engine_model.request import SimRequest
from shared.engine_model.scheduler import SimScheduler
from shared.prefix_hash import block_hashes

BS = 4


def make(num_blocks: int = 64, **overrides) -> SimScheduler:
    settings = dict(num_blocks=num_blocks, block_size=BS, max_model_len=256, max_num_batched_tokens=64,
                    enable_prefix_caching=True)
    config = SchedulerConfig(**(settings | overrides))
    return SimScheduler(config)


def request(rid: str, tokens: list[int], max_tokens: int = 2) -> SimRequest:
    return SimRequest(rid, len(tokens), max_tokens, block_hashes=tuple(block_hashes(tokens, BS)))


def run_until_done(s: SimScheduler, now: float = 0.0) -> float:
    while s.has_work():
        out = s.schedule(now)
        now += 1.0
        s.update_from_output(out, now)
        s.check_invariants()
    return now


def test_hit_after_a_finished_request_skips_the_cached_prefill():
    s = make()
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    s.add_request(first := request("a", prompt))
    run_until_done(s)
    assert first.num_cached_tokens == 0
    s.add_request(second := request("b", prompt + [7, 8, 9]))
    out = s.schedule(10.0)
    assert second.num_cached_tokens == 2 * BS
    assert out.num_new_tokens == [13 - 2 * BS]  # only the uncached suffix is prefilled
    assert out.prefill_chunks == [(13 - 2 * BS, 2 * BS)]  # attention still spans the cached prefix
    assert s.prefix_cache.num_hit_tokens == 2 * BS and s.prefix_cache.num_query_tokens == 10 + 13
    s.check_invariants()


def test_a_partial_block_is_never_reused():
    s = make()
    s.add_request(request("a", [1, 2, 3, 4, 5, 6]))  # one full block, a partial one
    run_until_done(s)
    s.add_request(b := request("b", [1, 2, 3, 4, 5, 6, 9]))
    s.schedule(5.0)
    assert b.num_cached_tokens == BS  # the partial block's [5, 6] is computed again


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = make()
    prompt = list(range(8))
    s.add_request(request("a", prompt))
    run_until_done(s)
    s.add_request(b := request("b", prompt))
    out = s.schedule(5.0)
    assert b.num_cached_tokens == BS and out.num_new_tokens == [len(prompt) - BS]


def test_different_prefix_same_block_tokens_do_not_hit():
    s = make()
    s.add_request(request("a", [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    run_until_done(s)
    s.add_request(b := request("b", [9, 9, 9, 9, 2, 2, 2, 2, 0]))
    s.schedule(5.0)
    assert b.num_cached_tokens == 0  # block 2 has the same tokens but another parent


def test_concurrent_requests_share_blocks_with_reference_counts():
    s = make()
    prefix = list(range(50, 58))
    s.add_request(request("a", prefix + [1]))
    run_until_done(s)
    s.add_request(b := request("b", prefix + [2], max_tokens=5))
    s.add_request(c := request("c", prefix + [3], max_tokens=5))
    s.schedule(5.0)
    s.check_invariants()
    bm = s.block_manager
    shared = bm.blocks_of("b")[:2]
    assert bm.blocks_of("c")[:2] == shared and b.num_cached_tokens == c.num_cached_tokens == 2 * BS
    assert bm.num_used == 2 + 1 + 1  # the shared prefix is held once
    s.abort_request("b")
    s.check_invariants()
    assert s.prefix_cache.count_evictable(shared) == 0  # c still holds them


def test_free_cached_blocks_are_evicted_least_recently_freed_first_and_tail_first():
    bm = BlockManager(num_blocks=6, block_size=BS, prefix_caching=True)
    cache = bm.cache
    a = bm.allocate("a", 2)
    bm.cache_full_blocks("a", [11, 12], 2 * BS)
    b = bm.allocate("b", 2)
    bm.cache_full_blocks("b", [21, 22], 2 * BS)
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free == 6 and cache.num_evictable == 4
    bm.allocate("c", 2)  # the two never-cached blocks go first: nothing evicted
    assert cache.num_cached == 4
    bm.allocate("d", 1)
    assert not cache.holds(12) and cache.holds(11)  # a's tail before a's head, a before b
    bm.allocate("e", 2)
    assert not cache.holds(11) and not cache.holds(22) and cache.holds(21)
    assert a[1] in bm.blocks_of("d")
    bm.check_invariants()
    assert b  # (b's blocks were freed after a's)


def test_a_hit_revives_an_evictable_block_so_it_is_not_evicted():
    bm = BlockManager(num_blocks=3, block_size=BS, prefix_caching=True)
    bm.allocate("a", 2)
    bm.cache_full_blocks("a", [5, 6], 2 * BS)
    bm.free("a")
    hit = bm.cache.longest_hit([5, 6, 7], 3)
    assert len(hit) == 2
    # The count alone, as the index and a load report ask it: the same run, capped alike.
    assert [bm.cache.matched_blocks([5, 6, 7], n) for n in (None, 3, 1, 0, -1)] == [2, 2, 1, 0, 0]
    assert bm.cache.matched_blocks([7, 5]) == 0  # a leading run: none past the first miss
    bm.allocate("b", 3, cached=hit)  # 2 hits + the one plain block
    assert bm.num_free == 0 and bm.cache.num_evictions == 0
    bm.check_invariants()


def test_preempted_request_finds_its_own_prefix_when_readmitted():
    # 8 blocks of 4: two 12-token prompts that grow to 24 tokens cannot run side by side.
    s = make(num_blocks=8, reserve_full_sequence=False)
    s.add_request(a := request("a", list(range(12)), max_tokens=12))
    s.add_request(b := request("b", list(range(100, 112)), max_tokens=12))
    now, readmitted_with = 0.0, None
    while s.has_work():
        was_preempted = b.status.name == "PREEMPTED"
        out = s.schedule(now)
        if was_preempted and b in out.requests:
            readmitted_with = b.num_computed_tokens  # before the step computes anything
        now += 1.0
        s.update_from_output(out, now)
        s.check_invariants()
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    # b's freed prompt blocks stayed cached, tail first evicted while a grew: its head survives.
    assert readmitted_with is not None and 0 < readmitted_with < 12 and readmitted_with % BS == 0
    assert s.prefix_cache.num_evictions > 0


def test_random_workload_keeps_every_invariant_and_hits_shared_prefixes():
    rng = random.Random(7)
    s = make(num_blocks=40)
    system_prompts = [[rng.randrange(1000) for _ in range(16)] for _ in range(3)]
    now = 0.0
    for i in range(200):
        prompt = rng.choice(system_prompts) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        s.add_request(request(f"r{i}", prompt, max_tokens=rng.randrange(1, 12)))
        if rng.random() < 0.1 and s.running:
            s.abort_request(rng.choice(s.running).request_id, now)
        for _ in range(rng.randrange(0, 3)):
            out = s.schedule(now)
            now += 1.0
            s.update_from_output(out, now)
            s.check_invariants()
    run_until_done(s, now)
    cache = s.prefix_cache
    assert cache.num_hit_tokens > 0.3 * cache.num_query_tokens
    assert s.block_manager.num_used == 0 and s.block_manager.num_free == 40


def test_prefix_caching_off_changes_nothing():
    def trace(enable: bool) -> list[tuple[int, ...]]:
        rng = random.Random(11)
        config = SchedulerConfig(num_blocks=20, block_size=BS, max_model_len=256, enable_prefix_caching=enable)
        s, steps, now = SimScheduler(config), [], 0.0
        prompt = [rng.randrange(50) for _ in range(9)]
        for i in range(30):
            s.add_request(SimRequest(f"r{i}", 9, 3))  # no hashes: the cache is never consulted
            out = s.schedule(now)
            now += 1
            s.update_from_output(out, now)
            steps.append(tuple(out.num_new_tokens) + tuple(s.block_ids_of(r.request_id)[0] for r in s.running))
        assert prompt
        return steps

    assert trace(True) == trace(False)


def test_the_waiting_prefill_a_report_tells_leaves_out_the_prefixes_cached_now():
    s = make()
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    s.add_request(request("a", prompt))
    run_until_done(s)
    s.add_request(request("b", prompt + [7, 8, 9]))  # 13 tokens, 2 blocks cached: 5 to prefill
    s.add_request(request("c", list(range(300, 307))))  # 7 tokens, none cached
    s.add_request(request("d", prompt[:8]))  # fully cached: its last token is still computed (4)
    assert s.waiting_prefill_tokens() == 5 + 7 + 4
    out = s.schedule(10.0)  # admitted: their prefill is no longer waiting
    assert out.requests and s.waiting_prefill_tokens() == 0 == len(s.waiting)
    uncached = SimScheduler(SchedulerConfig(num_blocks=64, block_size=BS, max_model_len=256))
    uncached.add_request(request("e", prompt))
    assert uncached.waiting_prefill_tokens() is None  # no cache: a report tells no more than its demand
