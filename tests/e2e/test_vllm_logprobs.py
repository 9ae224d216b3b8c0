"""Logprobs through Corral with a real vLLM llumlet, read with the openai SDK: the gateway asks the
engine for them and returns vLLM's numbers in OpenAI's shapes."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from tests.support.cluster import running_cluster

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # (a minute of real vLLM: CI's `slow` run)
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

VLLM_ARGS = ("--max-model-len", "512", "--vllm-kv-cache-gib", "0.01", "--vllm-max-num-seqs", "4")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("vllm-logprobs"), ["vllm-lp"], *VLLM_ARGS,
                         engine="vllm", timeout_s=300) as cluster:
        yield cluster


async def test_chat_logprobs_are_the_engine_s_in_openai_s_shape(cluster):
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0)
    reply = await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Tell me about corrals"}], max_tokens=12,
        temperature=0.0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == values[0]  # greedy: the best
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    await client.close()


async def test_streamed_completion_logprobs_follow_the_text(cluster):
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0)
    stream = await client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8,
                                             temperature=0.0, logprobs=2, stream=True,
                                             extra_body={"ignore_eos": True})
    tokens, offsets, text = [], [], ""
    async for chunk in stream:
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            offsets += choice.logprobs.text_offset
            assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
        text += choice.text
    assert len(tokens) == 8 and offsets == sorted(offsets) and offsets[0] == 0
    assert "".join(tokens).startswith(text[:1])
    await client.close()
