"""usage.prompt_tokens_details.cached_tokens with a real vLLM llumlet (its prefix cache is on by
default): the same prompt twice, the second finds the first's blocks, as vLLM's own server with
--enable-prompt-tokens-details reports it."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from tests.support.cluster import running_cluster

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

VLLM_ARGS = ("--max-model-len", "512", "--vllm-kv-cache-gib", "0.01", "--vllm-max-num-seqs", "4")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("vllm-cached"), ["vllm-ct"], *VLLM_ARGS,
                         engine="vllm", gateway_args=["--enable-prompt-tokens-details"], timeout_s=300) as cluster:
        yield cluster


async def _chat_usage(client: openai.AsyncOpenAI, prompt: str):
    stream = await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0.0,
        stream=True, stream_options={"include_usage": True})
    return [chunk.usage async for chunk in stream if chunk.usage is not None][-1]


async def test_the_second_of_two_equal_prompts_finds_its_prefix_in_vllm_s_cache(cluster):
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0)
    prompt = "The corral keeps the horses in at night and lets them out at dawn. " * 6
    completions = [await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0.0)
                   for _ in range(2)]
    chats = [await _chat_usage(client, "Once more: " + prompt) for _ in range(2)]  # streamed: the final usage chunk
    await client.close()
    cold, warm = (c.usage for c in completions)
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert 0 < warm.prompt_tokens_details.cached_tokens < warm.prompt_tokens == cold.prompt_tokens
    assert chats[0].prompt_tokens_details.cached_tokens < chats[1].prompt_tokens_details.cached_tokens
    assert chats[1].prompt_tokens_details.cached_tokens < chats[1].prompt_tokens
