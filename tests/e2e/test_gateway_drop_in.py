"""The gateway as vLLM's users meet it, through real processes: API keys from the environment,
readiness, the context the llumlets really run, SSE timing, n > 1 and the SDK's models.retrieve."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.support.cluster import Cluster

KEYS = ("e2e-key-1", "e2e-key-2")
SHORT, LONG = 300, 400  # the llumlets' contexts; the model's config.json says 4096
SIM = ("--sim-time-scale", "0.1", "--sim-num-blocks", "400")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    from shared.embedded_nats import start_nats

    nats = start_nats()
    cluster = Cluster(nats.url, tiny_model_dir, tmp_path_factory.mktemp("drop-in-logs"))
    cluster.start_scheduler()
    cluster.start_llumlet("short", *SIM, "--max-model-len", str(SHORT))
    cluster.start_llumlet("long", *SIM, "--max-model-len", str(LONG))
    cluster.spawn("gateway", "gateway", "--model", str(tiny_model_dir), "--port", str(_port(cluster)),
                  env={"CORRAL_API_KEY": ",".join(KEYS)})
    try:
        _wait_ready(cluster, instances=2)
        yield cluster
    finally:
        cluster.stop()
        nats.stop()


def _port(cluster: Cluster) -> int:
    from tests.support.cluster import free_port

    cluster.gateway_port = free_port()
    return cluster.gateway_port


def _wait_ready(cluster: Cluster, instances: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(f"{cluster.base_url}/ready", timeout=1.0)
            if reply.status_code == 200 and reply.json()["instances"] >= instances:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("\n".join(p.log()[-2000:] for p in cluster.procs.values()))


def sdk(cluster: Cluster, key: str = KEYS[1]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key=key, max_retries=0)


async def test_keys_from_the_environment_guard_v1_only(cluster):
    async with httpx.AsyncClient(base_url=cluster.base_url) as http:
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.get("/v1/models", headers={"authorization": f"Bearer {KEYS[0]}"})).status_code == 200
        for path in ("/health", "/ready", "/metrics", "/version", "/openapi.json"):
            assert (await http.get(path)).status_code == 200, path
    log = cluster.procs["gateway"].log()
    assert not any(key in log for key in KEYS)  # never logged


async def test_the_context_is_the_shortest_llumlet_s_and_refusals_say_so_as_vllm(cluster):
    client = sdk(cluster)
    model = await client.models.retrieve("tiny-llama")
    assert model.id == "tiny-llama" and model.model_extra["max_model_len"] == SHORT
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=SHORT + 1)
    assert info.value.body["param"] == "max_tokens"
    assert f"cannot be greater than max_model_len={SHORT}" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="tiny-llama", prompt="word " * (2 * SHORT), max_tokens=4)
    assert info.value.body["param"] == "prompt"
    assert info.value.body["message"].startswith(f"This model's maximum context length is {SHORT} tokens.")
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")
    await client.close()


async def test_role_chunk_arrives_with_the_first_token(cluster):
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30,
                                 headers={"authorization": f"Bearer {KEYS[0]}", "x-request-id": "e2e-7"}) as http:
        started = time.monotonic()
        arrivals = []
        async with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "a longer prompt " * 20}], "max_tokens": 8,
                "stream": True}) as response:
            assert response.status_code == 200 and response.headers["x-request-id"] == "e2e-7"
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.monotonic() - started, json.loads(line[6:])))
    (role_at, role), (first_at, first) = arrivals[:2]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and role["id"] == "chatcmpl-e2e-7"
    assert first["choices"][0]["delta"].get("content")
    assert first_at - role_at < 0.005


async def test_n_choices_come_back_indexed(cluster):
    client = sdk(cluster)
    reply = await client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=6, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 18
    stream = await client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, n=2, stream=True)
    finished = {c.choices[0].index: c.choices[0].finish_reason async for c in stream if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    await client.close()
