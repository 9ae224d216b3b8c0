"""vLLM's own KV-cache events reach the llumlet's journal in process, under the gateway's hashes:
the blocks a prompt leaves in vLLM's prefix cache are the chain `shared.prefix_hash` computes
for it (sha256_cbor), so the scheduler's index and the gateway's dispatch request agree."""

from __future__ import annotations

from shared.messages import GenerateRequest, SamplingParams
from shared.prefix_hash import block_hashes
from tests.vllm.helpers import BLOCK_SIZE


async def _run(engine, request_id: str, prompt: list[int]) -> int:
    engine.add_request(GenerateRequest(request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0),
                                       f"test.{request_id}"))
    cached = 0
    for _ in range(200):
        if not engine.has_work():
            break
        for output in await engine.step():
            cached = max(cached, output.num_cached_tokens or 0)
    return cached


async def test_a_prompts_full_blocks_are_stored_under_the_gateways_hashes(vllm_engine):
    journal = vllm_engine.kv_event_journal()
    assert journal is not None, "prefix caching is on by default: the engine must report its cache"
    journal.take()  # whatever earlier tests of the module left
    prompt = [11 + (i * 29) % 350 for i in range(3 * BLOCK_SIZE + 5)]
    assert await _run(vllm_engine, "kv-first", prompt) == 0
    delta = journal.take()
    expected = block_hashes(prompt, BLOCK_SIZE)
    assert len(expected) == 3
    assert set(expected) <= set(delta.stored), (expected, delta.stored)
    # The same prompt again: a hit on those blocks, and nothing new to store.
    assert await _run(vllm_engine, "kv-again", prompt) == 3 * BLOCK_SIZE
    assert not set(expected) & set(journal.take().removed)
    _, held = journal.take_with_snapshot()
    assert set(expected) <= set(held)


async def test_the_waiting_prefill_leaves_out_what_the_prefix_cache_holds(vllm_engine):
    """The load report's `waiting_prefill_tokens`: a prompt whose three full blocks vLLM caches
    counts only its last 5 tokens while it waits; a fresh prompt counts whole; a prompt queued
    for the engine thread counts whole until vLLM has it."""
    prompt = [17 + (i * 31) % 340 for i in range(3 * BLOCK_SIZE + 5)]
    fresh = [23 + (i * 37) % 330 for i in range(2 * BLOCK_SIZE + 3)]
    await _run(vllm_engine, "wp-first", prompt)
    assert vllm_engine.waiting_prefill_tokens() == 0
    for request_id, tokens in (("wp-again", prompt), ("wp-fresh", fresh)):
        vllm_engine.add_request(GenerateRequest(request_id, tokens, SamplingParams(max_tokens=2, temperature=0.0),
                                                f"test.{request_id}"))
    told = vllm_engine.waiting_prefill_tokens()
    await vllm_engine.on_engine_thread(lambda driver: None)  # the adds are applied before it
    assert told in (len(prompt) + len(fresh), 5 + len(fresh)), told  # queued, or in vLLM by then
    assert vllm_engine.waiting_prefill_tokens() == 5 + len(fresh)
    views = vllm_engine.request_views()
    assert {v.request_id for v in views} == {"wp-again", "wp-fresh"} and all(v.phase.name == "WAITING" for v in views)
    for _ in range(200):
        if not vllm_engine.has_work():
            break
        await vllm_engine.step()
    assert vllm_engine.waiting_prefill_tokens() == 0
