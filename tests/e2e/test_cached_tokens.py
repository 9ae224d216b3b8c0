"""usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details), end to end:
the sim engine's prefix cache → the llumlet's first chunk of a request → the gateway's usage, on
both endpoints, streaming (the final usage chunk) and not."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.cluster import running_cluster

SIM_ARGS = ("--sim-time-scale", "0.1", "--sim-num-blocks", "400", "--max-model-len", "2048",
            "--sim-prefix-caching", "--sim-block-size", "16")


@pytest.fixture(scope="module")
def cached_cluster(tiny_model_dir, tmp_path_factory):
    # One instance: the second request must find the first's blocks.
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("cached-logs"), ["ct-0"], *SIM_ARGS,
                         gateway_args=["--enable-prompt-tokens-details"]) as cluster:
        yield cluster


def _final_usage(body: str) -> dict:
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    usage = [e["usage"] for e in events if not e["choices"] and e.get("usage")]
    assert len(usage) == 1, body
    return usage[0]


async def test_the_same_prompt_twice_finds_its_prefix_cached(cached_cluster):
    async with httpx.AsyncClient(base_url=cached_cluster.base_url, timeout=60) as http:
        name = (await http.get("/v1/models")).json()["data"][0]["id"]
        prompt = [11] * 48 + list(range(200, 248))  # 96 token ids: 6 full blocks of 16
        first = await http.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 4})
        assert first.status_code == 200, first.text
        usage = first.json()["usage"]
        assert usage["prompt_tokens"] == 96
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # a cold cache: looked up, none found

        second = await http.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 4})
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < 96 and cached % 16 == 0  # whole blocks; the last token is always computed

        streamed = await http.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 4,
                                                            "stream": True,
                                                            "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200, streamed.text
        assert _final_usage(streamed.text)["prompt_tokens_details"]["cached_tokens"] == cached


async def test_chat_reports_cached_tokens_streaming_and_not(cached_cluster):
    async with httpx.AsyncClient(base_url=cached_cluster.base_url, timeout=60) as http:
        name = (await http.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": name, "max_tokens": 4,
                "messages": [{"role": "user", "content": "a long shared system prompt, " * 12}]}
        cold = (await http.post("/v1/chat/completions", json=body)).json()["usage"]
        warm = await http.post("/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True,
                                                                                "continuous_usage_stats": True}})
        assert warm.status_code == 200, warm.text
        events = [json.loads(line[6:]) for line in warm.text.splitlines() if line.startswith("data: {")]
        # As vLLM: the continuous stats on each chunk leave the details out; the final usage has them.
        continuous = [e["usage"] for e in events if e["choices"] and "usage" in e]  # the role chunk has none
        assert continuous and all("prompt_tokens_details" not in usage for usage in continuous)
        warm_usage = _final_usage(warm.text)
    assert cold["prompt_tokens_details"]["cached_tokens"] < warm_usage["prompt_tokens_details"]["cached_tokens"]
    assert warm_usage["prompt_tokens_details"]["cached_tokens"] < warm_usage["prompt_tokens"]
