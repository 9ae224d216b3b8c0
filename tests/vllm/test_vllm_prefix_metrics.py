"""The llumlet's prefix-cache counters read what vLLM found: the same prompt twice is a hit."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.llumlet.metrics import LlumletMetrics
from shared.messages import GenerateRequest, SamplingParams
from shared.metrics_server import render
from tests.vllm.helpers import BLOCK_SIZE


def counter(metrics: LlumletMetrics, name: str) -> float:
    text = render(metrics.registry).decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def test_a_repeated_prompt_counts_its_full_blocks_as_prefix_hits(vllm_engine):
    prompt = [7 + (i * 13) % 300 for i in range(3 * BLOCK_SIZE + 5)]
    metrics = LlumletMetrics("tiny", "llumlet-0")
    for attempt in ("first", "again"):
        vllm_engine.add_request(GenerateRequest(attempt, prompt, SamplingParams(max_tokens=2, temperature=0.0),
                                                f"test.{attempt}"))
        for _ in range(200):
            if not vllm_engine.has_work():
                break
            metrics.step_done(0.0, 0.0, await vllm_engine.step())
    assert counter(metrics, "vllm:prefix_cache_queries_total") == 2 * len(prompt)
    # The first found nothing; the second its 3 full blocks (vLLM never counts the last token's block).
    assert counter(metrics, "vllm:prefix_cache_hits_total") == 3 * BLOCK_SIZE
