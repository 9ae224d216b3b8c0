"""The sim llumlet's engine caches prompt prefixes under the hashes a gateway computes."""

from __future__ import annotations

from services.llumlet.engines.sim.engine import SimEngine
from shared.messages import GenerateRequest, SamplingParams
from shared.prefix_hash import block_hashes
from tests.unit.migration_helpers import sim_config

FAST = dict(time_scale=1e-5, num_blocks=64, block_size=4, max_model_len=512, enable_prefix_caching=True)


def gen(rid: str, tokens: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, tokens, SamplingParams(max_tokens=2, ignore_eos=True), reply_subject="out")


async def run(engine: SimEngine) -> None:
    while engine.has_work():
        await engine.step()


async def test_the_engine_holds_the_gateways_hashes_and_reuses_them():
    engine = SimEngine(sim_config(**FAST))
    await engine.start()
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    gateway_chain = block_hashes(prompt, 4)  # what the gateway would send with the dispatch
    engine.add_request(gen("a", prompt))
    outputs = [o for _ in range(50) if engine.has_work() for o in await engine.step()]
    assert outputs and all(o.num_cached_tokens == 0 for o in outputs)  # looked up, nothing found
    cache = engine.scheduler.prefix_cache
    assert cache.matched_blocks(gateway_chain) == len(gateway_chain) == 2
    engine.add_request(gen("b", prompt[:8] + [99, 98, 97]))
    assert engine.waiting_prefill_tokens() == 3  # what its load reports tell dispatch is queued
    first_step = engine.scheduler.schedule(0.0)
    assert engine.scheduler.get("b").num_cached_tokens == 8 and first_step.num_new_tokens == [3]
    engine.scheduler.update_from_output(first_step, 0.0)
    outputs = [o for _ in range(50) if engine.has_work() for o in await engine.step()]
    assert outputs[0].num_cached_tokens == 8  # what the llumlet counts as vllm:prefix_cache_hits
    await engine.stop()


async def test_without_prefix_caching_nothing_is_hashed():
    engine = SimEngine(sim_config(**{**FAST, "enable_prefix_caching": False}))
    assert engine.scheduler.prefix_cache is None
    assert engine.waiting_prefill_tokens() is None
    assert engine.to_sim(gen("a", list(range(1, 20)))).block_hashes == ()
