"""The gateway over a real nats-server: migrated streams, silent instances, bad payloads, aborts on
stop and on client disconnect, readiness, n > 1 choices."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import uvicorn

from services.gateway.app import create_app
from shared import subjects
from shared.messages import DispatchReply, FinishReason, GenerateRequest, TokenChunk
from tests.support.cluster import free_port
from tests.unit.gateway_nats_harness import (
    CHAT,
    HELLO,
    INSTANCE_TIMEOUT_S,
    OUTPUT,
    cluster,
    eventually,
    text_of,
    tokenizer,
)


async def test_migrated_request_streams_each_token_once(cluster, tokenizer):
    source, destination = await cluster.llumlet("src"), await cluster.llumlet("dst")
    await cluster.scheduler(lambda request: DispatchReply(instance_id=source.instance_id))
    await cluster.until_alive(2)

    def migrate(request: GenerateRequest) -> list[TokenChunk | float]:
        request_id = request.request_id
        asyncio.get_running_loop().call_later(0.03, lambda: destination._tasks.append(asyncio.create_task(
            destination._stream(request, [destination.chunk(request, 3, OUTPUT[3:6]),
                                          destination.chunk(request, 6, OUTPUT[6:], FinishReason.STOP)]))))
        assert request_id
        return [source.chunk(request, 0, OUTPUT[:2]), 0.06, source.chunk(request, 2, OUTPUT[2:4])]  # late, overlapping

    source.emit = migrate
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == text_of(tokenizer, OUTPUT)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_request_fails_when_its_instance_goes_silent(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)

    def die(request: GenerateRequest) -> list[TokenChunk | float]:
        llumlet.reporting = False
        return [llumlet.chunk(request, 0, OUTPUT[:2])]

    llumlet.emit = die
    started = time.monotonic()
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    assert time.monotonic() - started < INSTANCE_TIMEOUT_S + 2.0
    events = response.text.split("\n\n")
    error = json.loads(events[-3][len("data: "):])["error"]
    assert error["code"] == 503 and llumlet.instance_id in error["message"] and events[-2] == "data: [DONE]"
    await eventually(lambda: bool(llumlet.aborts))
    assert llumlet.aborts == [llumlet.requests[0].request_id]


async def test_bad_payloads_are_dropped_without_harm(cluster, tokenizer):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    await cluster.nc.publish(cluster.gateway.output_subject, b"\x93garbage")
    await cluster.nc.publish(subjects.load_report("junk"), b"not msgpack")
    body = (await cluster.client.post(CHAT, json={"messages": HELLO})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT)
    assert len(llumlet.requests) == 1


async def test_unacknowledged_generate_is_a_503_and_aborted(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    await llumlet._subs.pop(0).unsubscribe()
    silent = await cluster.nc.subscribe(subjects.llumlet(llumlet.instance_id, "generate"))  # takes, never answers
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 503 and "acknowledge" in response.json()["error"]["message"]
    await eventually(lambda: len(llumlet.aborts) == 1)
    await silent.unsubscribe()


async def test_stop_aborts_open_requests(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.emit = lambda request: [llumlet.chunk(request, 0, OUTPUT[:1]), 30.0]
    pending = asyncio.create_task(cluster.client.post(CHAT, json={"messages": HELLO}))
    while not llumlet.requests:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    cluster.gateway.fail_all("the gateway is shutting down")
    response = await pending
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
    await eventually(lambda: bool(llumlet.aborts))
    assert llumlet.aborts == [llumlet.requests[0].request_id]


async def test_client_disconnect_over_real_http_aborts_the_request(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.emit = lambda request: [llumlet.chunk(request, i, [t]) for i, t in enumerate(OUTPUT[:3])] + [30.0]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cluster.gateway), host="127.0.0.1", port=port,
                                           log_config=None, lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            async with client.stream("POST", CHAT, json={"messages": HELLO, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if '"content":"' in line and '"role"' not in line:
                        break  # first token seen; leave
        await eventually(lambda: bool(llumlet.aborts))
        assert llumlet.aborts == [llumlet.requests[0].request_id]
        assert len(cluster.gateway.streams) == 0
    finally:
        server.should_exit = True
        await serving


async def test_limits_are_the_smallest_live_instance_context(cluster):
    await cluster.llumlet("long", max_model_len=90)
    short = await cluster.llumlet("short", max_model_len=60)
    await cluster.until_alive(2)
    [card] = (await cluster.client.get("/v1/models")).json()["data"]
    assert card["max_model_len"] == 60  # not the model's 128
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "max_completion_tokens": 61})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "max_completion_tokens=61 cannot be greater than max_model_len=60. Please request fewer output "
                   "tokens.", "type": "BadRequestError", "param": "max_completion_tokens", "code": 400}
    response = await cluster.client.post("/v1/completions", json={"prompt": list(range(5, 75)), "max_tokens": 4})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt"
    assert error["message"] == ("This model's maximum context length is 60 tokens. However, your prompt contains 70 "
                                "input tokens, which exceeds this limit even without any output tokens. Please "
                                "reduce the length of the input prompt.")
    short.reporting = False  # gone: the limit follows the instances that are left
    await eventually(lambda: cluster.gateway.max_model_len == 90, timeout_s=5)


async def test_ready_only_with_a_live_instance(cluster):
    response = await cluster.client.get("/ready")
    assert response.status_code == 503 and response.json()["status"] == "no live instance"
    assert (await cluster.client.get("/health")).status_code == 200
    await cluster.llumlet("a")
    await cluster.llumlet("b")
    await cluster.until_alive(2)
    response = await cluster.client.get("/ready")
    assert response.status_code == 200 and response.json()["instances"] == 2 and response.json()["connected"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_n_choices_run_as_n_requests(cluster, tokenizer, stream):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "n": 3, "max_tokens": 5, "seed": 7,
                                                     "stream": stream})
    assert response.status_code == 200
    assert len({r.request_id for r in llumlet.requests}) == 3
    assert sorted(r.sampling.seed for r in llumlet.requests) == [7, 8, 9]  # n equal seeds would give n equal choices
    expected = text_of(tokenizer, OUTPUT[:5])
    if not stream:
        body = response.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["message"]["content"] == expected and c["finish_reason"] == "length" for c in body["choices"])
        assert body["usage"]["completion_tokens"] == 15
        assert body["usage"]["prompt_tokens"] == len(llumlet.requests[0].prompt_token_ids)
        return
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    by_index: dict[int, list[dict]] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == expected
        assert [c["finish_reason"] for c in choices][-1] == "length"
    assert len({c["id"] for c in chunks}) == 1
    await eventually(lambda: len(cluster.gateway.streams) == 0)
