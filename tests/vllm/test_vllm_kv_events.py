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
