"""Gateway → global scheduler → simulated llumlets, every hop a real process over real NATS."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.support.observer import NatsObserver


def model_name(cluster) -> str:
    return httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]


async def test_streamed_chat_completion_with_the_openai_client(sim_cluster):
    client = openai.AsyncOpenAI(base_url=f"{sim_cluster.base_url}/v1", api_key="none")
    stream = await client.chat.completions.create(
        model=model_name(sim_cluster),
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens > 0


async def test_non_streaming_completion_returns_usage(sim_cluster):
    async with httpx.AsyncClient(base_url=sim_cluster.base_url, timeout=30) as http:
        reply = await http.post("/v1/completions", json={"model": model_name(sim_cluster), "prompt": "Once", "max_tokens": 7})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == "length"


async def test_fifty_concurrent_requests_complete_and_spread(sim_cluster):
    name = model_name(sim_cluster)
    async with NatsObserver(sim_cluster.nats_url) as observer:
        async with httpx.AsyncClient(base_url=sim_cluster.base_url, timeout=60) as http:

            async def one(i: int) -> dict:
                reply = await http.post(
                    "/v1/chat/completions",
                    json={"model": name, "messages": [{"role": "user", "content": f"request {i} " * 20}], "max_tokens": 64},
                )
                assert reply.status_code == 200, reply.text
                return reply.json()

            # A queue shows in a report only when one lands between an arrival and the next step;
            # on a slow machine a burst can miss that, so up to three bursts, each checked.
            for burst in range(1, 4):
                results = await asyncio.gather(*(one(i) for i in range(50)))
                assert all(r["usage"]["completion_tokens"] == 64 for r in results)
                counts = observer.generate_orders
                assert sum(counts.values()) == 50 * burst
                assert len(counts) == 3 and min(counts.values()) >= 10 * burst, counts
                if any(report.num_waiting > 0 for _, report in observer.reports):
                    break
        # No instance sat idle while another had a queue: whenever one reported a queue, every
        # other instance reported work at some point within 50 ms of it. The load is enough for
        # queues to form (else the check says nothing), and reports of other instances were near.
        queued = [(t, report) for t, report in observer.reports if report.num_waiting > 0]
        assert queued, "no instance ever reported a queue: the load no longer tests balance"
        compared = 0
        for t, report in queued:
            for other_id in counts:
                if other_id == report.instance_id:
                    continue
                nearby = [o for t2, o in observer.reports if o.instance_id == other_id and abs(t2 - t) < 0.05]
                compared += bool(nearby)
                assert not nearby or any(o.num_running + o.num_waiting > 0 for o in nearby), (report, nearby)
        assert compared, "no other instance reported near a queue: nothing was compared"


async def test_client_disconnect_frees_blocks(sim_cluster):
    name = model_name(sim_cluster)
    async with NatsObserver(sim_cluster.nats_url) as observer:
        assert await observer.wait_for(lambda latest: len(latest) == 3)
        async with httpx.AsyncClient(base_url=sim_cluster.base_url, timeout=30) as http:
            async with http.stream(
                "POST", "/v1/chat/completions",
                json={"model": name, "messages": [{"role": "user", "content": "long " * 200}], "max_tokens": 1500, "stream": True},
            ) as reply:
                assert reply.status_code == 200
                seen = 0
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        seen += 1
                    if seen >= 3:
                        break
            busy = await observer.wait_for(lambda latest: any(r.num_blocks_free < r.num_blocks_total for r in latest.values()), 5)
            assert busy
        # The stream is closed: every instance must come back to all blocks free.
        assert await observer.wait_for(
            lambda latest: all(r.num_blocks_free == r.num_blocks_total and r.num_running == 0 for r in latest.values()),
            timeout_s=10,
        ), observer.latest


BAD_REQUESTS = [
    ("not json", None, 400),
    ({"model": "MODEL"}, None, 400),  # missing messages
    ({"model": "MODEL", "messages": []}, None, 400),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, 400),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "priority": "urgent"}, None, 400),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "word " * 5000}]}, None, 400),  # too long
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, None, 404),
    ({"model": "MODEL", "messages": [{"role": "user", "content": "hi"}]}, {"X-Corral-Priority": "bogus"}, 400),
]


@pytest.mark.parametrize("body,headers,status", BAD_REQUESTS)
async def test_bad_input_gets_a_clear_error(sim_cluster, body, headers, status):
    name = model_name(sim_cluster)
    async with httpx.AsyncClient(base_url=sim_cluster.base_url, timeout=30) as http:
        if isinstance(body, dict):
            payload = json.dumps(body).replace('"MODEL"', json.dumps(name))
        else:
            payload = body
        reply = await http.post("/v1/chat/completions", content=payload, headers={"content-type": "application/json", **(headers or {})})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["code"] == status


async def test_gateway_keeps_serving_with_the_scheduler_killed(sim_cluster):
    sim_cluster.procs["scheduler"].kill()
    name = model_name(sim_cluster)
    async with httpx.AsyncClient(base_url=sim_cluster.base_url, timeout=30) as http:
        replies = await asyncio.gather(*(
            http.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 5})
            for i in range(12)
        ))
        assert [r.status_code for r in replies] == [200] * 12
        metrics = (await http.get("/metrics")).text
    bypass = [line for line in metrics.splitlines() if line.startswith("corral:gateway_bypass_dispatches_total")]
    assert bypass and float(bypass[0].split()[-1]) >= 12
