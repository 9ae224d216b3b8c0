"""Corral with two real vLLM llumlets: exact greedy output, streaming, preemptions, disconnects."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.cluster import running_cluster
from tests.support.observer import NatsObserver

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

MAX_MODEL_LEN = 512
# 6 blocks of 128 tokens at 1 KiB per token: a few long requests force preemptions.
KV_GIB = 6 * 128 * 1024 / (1 << 30)
VLLM_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--vllm-kv-cache-gib", f"{KV_GIB:.10f}", "--vllm-max-num-seqs", "8")


@pytest.fixture(scope="module")
def vllm_cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("vllm-cluster"), ["vllm-0", "vllm-1"], *VLLM_ARGS,
                         engine="vllm", timeout_s=240) as cluster:
        yield cluster


def model_name(cluster) -> str:
    return httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]


async def test_greedy_output_matches_vllm_generate(vllm_cluster, tiny_model_dir):
    from tests.vllm.helpers import start_reference_run, small_engine_config_for

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer.encode(text) for text in ("The quick brown fox", "Corral moves requests", "你好，世界")]
    sampling = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    reference = start_reference_run(small_engine_config_for(tiny_model_dir), prompts, sampling)
    try:
        async with httpx.AsyncClient(base_url=vllm_cluster.base_url, timeout=60) as http:
            replies = await asyncio.gather(*(
                http.post("/v1/completions", json={"model": model_name(vllm_cluster), "prompt": ids, **sampling})
                for ids in prompts
            ))
        expected = await asyncio.to_thread(reference.result)
    finally:
        reference.close()
    for reply, ids in zip(replies, expected):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == len(ids) == 40
        assert body["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)


async def test_openai_client_streams_from_vllm(vllm_cluster):
    client = openai.AsyncOpenAI(base_url=f"{vllm_cluster.base_url}/v1", api_key="none")
    stream = await client.chat.completions.create(
        model=model_name(vllm_cluster), messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


async def test_small_kv_cache_forces_preemptions_shown_in_reports(vllm_cluster):
    name = model_name(vllm_cluster)
    async with NatsObserver(vllm_cluster.nats_url) as observer:
        async with httpx.AsyncClient(base_url=vllm_cluster.base_url, timeout=120) as http:
            replies = await asyncio.gather(*(
                http.post("/v1/completions", json={"model": name, "prompt": f"{i} " * 50, "max_tokens": 300,
                                                   "ignore_eos": True, "temperature": 0})
                for i in range(8)
            ))
        assert [r.status_code for r in replies] == [200] * 8
        assert all(r.json()["usage"]["completion_tokens"] == 300 for r in replies)
        assert await observer.wait_for(lambda latest: sum(r.num_preemptions_total for r in latest.values()) > 0, 5)


async def test_disconnect_frees_vllm_blocks(vllm_cluster):
    name = model_name(vllm_cluster)
    async with NatsObserver(vllm_cluster.nats_url) as observer:
        assert await observer.wait_for(lambda latest: len(latest) == 2 and all(r.num_running == 0 for r in latest.values()))
        baseline = {iid: r.num_blocks_free for iid, r in observer.latest.items()}
        async with httpx.AsyncClient(base_url=vllm_cluster.base_url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={
                "model": name, "prompt": "go " * 100, "max_tokens": 400, "ignore_eos": True, "stream": True,
            }) as reply:
                assert reply.status_code == 200
                async for line in reply.aiter_lines():
                    if '"text"' in line:
                        break
                # The request holds blocks while it streams...
                assert await observer.wait_for(
                    lambda latest: any(r.num_blocks_free < baseline[i] for i, r in latest.items()), 10
                )
        # ...and gave every one back once the client went away.
        assert await observer.wait_for(
            lambda latest: all(r.num_running == 0 and r.num_blocks_free == baseline[i] for i, r in latest.items()), 10
        ), (baseline, observer.latest)
