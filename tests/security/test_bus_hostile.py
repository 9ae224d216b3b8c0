"""Well-formed but hostile bus messages, one test per finding of issue 15 (each was measured
against commit 521d571: the comment says what it did then). Every one is refused at the edge,
counted in `corral:bus_rejected_messages_total`, and the cluster serves an ordinary request after."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import msgspec
import nats
import pytest

from shared import subjects
from shared.messages import (
    Ack, GenerateRequest, MigrationAbort, PreAlloc,
    PreAllocReply as PreAllocGrant, TokenChunk, decode, encode,
)
from shared.nats_client import flush_in_order
from tests.security.conftest import GATEWAY_ID, INSTANCES

REJECTED = "corral:bus_rejected_messages_total"


def raw_generate(reply_subject: str) -> bytes:
    """A GenerateRequest with a reply subject the schema would refuse, encoded around the schema."""
    return msgspec.msgpack.encode({"request_id": f"hostile-{reply_subject!r}", "prompt_token_ids": [1, 2, 3],
                                   "sampling": {"max_tokens": 4}, "reply_subject": reply_subject})


async def test_generate_with_unusable_reply_subject_is_refused_not_fatal(sec_cluster):
    # was: the llumlet exited 1 (publishing its first token to "" / "a b" / CRLF raised in the engine loop)
    instance = INSTANCES[0]
    before = sec_cluster.metric(instance, REJECTED, subject="corral.llumlet.*.generate", reason="invalid")
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    try:
        for reply_subject in ["", "a b", "corral.gateway.x.out\r\nPUB evil 1", "a..b", "x.*"]:
            reply = await nc.request(subjects.llumlet(instance, "generate"), raw_generate(reply_subject), timeout=5)
            ack = decode(reply.data, Ack)
            assert not ack.ok and ack.reason == "invalid", ack
    finally:
        await nc.close()
    await asyncio.sleep(0.5)
    sec_cluster.assert_all_alive()
    assert sec_cluster.metric(instance, REJECTED, subject="corral.llumlet.*.generate", reason="invalid") == before + 5
    assert sec_cluster.chat().status_code == 200


def hostile_report(**overrides) -> bytes:
    fields = dict(instance_id="ghost", seq=1, sent_at=time.time(), num_blocks_total=100, num_blocks_free=100,
                  block_size=16, num_running=0, num_waiting=0, head_demand_blocks=0, waiting_demand_blocks=0,
                  num_preemptions_total=0, max_model_len=2048, model="tiny-llama", engine="sim")
    return msgspec.msgpack.encode({**fields, **overrides})


@pytest.mark.parametrize("overrides", [
    {"block_size": 0}, {"instance_id": "bad id"}, {"instance_id": "ghost\n"}, {"num_blocks_free": -5},
    {"num_running": -1}, {"freeness": float("nan")}, {"num_blocks_free": 10**6},
    {"by_priority": [{"priority": 0}] * 5000},
], ids=lambda o: f"{next(iter(o))}={next(iter(o.values()))!r}"[:40])
async def test_impossible_load_report_is_refused(sec_cluster, overrides):
    # was: block_size=0 or instance_id="bad id" made the gateway answer 500 to ordinary requests
    before = {s: sec_cluster.metric(s, REJECTED, subject="corral.load.*", reason="invalid")
              for s in ("gateway", "scheduler")}
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    try:
        for _ in range(3):
            await nc.publish(subjects.load_report("ghost"), hostile_report(**overrides))
        await flush_in_order(nc)
    finally:
        await nc.close()
    await asyncio.sleep(0.3)
    for _ in range(4):  # dispatch still sees only the real instances
        assert sec_cluster.chat(max_tokens=2).status_code == 200
    health = httpx.get(f"{sec_cluster.base_url}/healthz", timeout=5).json()
    assert health["instances"] == len(INSTANCES)
    for service, count in before.items():
        assert sec_cluster.metric(service, REJECTED, subject="corral.load.*", reason="invalid") == count + 3, service
    sec_cluster.assert_all_alive()


async def test_a_load_report_about_another_instance_is_refused(sec_cluster):
    # was: taken as the other's (with "ghost\n" as its id, which `$` let through, the gateway then
    # answered 503 "not connected to NATS" to every request dispatch sent there)
    before = {s: sec_cluster.metric(s, REJECTED, subject="corral.load.*", reason="wrong_subject")
              for s in ("gateway", "scheduler")}
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    try:
        for _ in range(3):
            await nc.publish(subjects.load_report("ghost"), hostile_report(instance_id="phantom"))
        await flush_in_order(nc)
    finally:
        await nc.close()
    await asyncio.sleep(0.3)
    health = httpx.get(f"{sec_cluster.base_url}/healthz", timeout=5).json()
    assert health["instances"] == len(INSTANCES)
    for service, count in before.items():
        assert sec_cluster.metric(service, REJECTED, subject="corral.load.*", reason="wrong_subject") == count + 3
    assert sec_cluster.chat(max_tokens=2).status_code == 200


async def test_migrate_order_to_a_bad_id_is_refused_once_and_quietly(sec_cluster):
    # was: ~360 error tracebacks a second, for as long as the (bogus) pair stood
    instance = INSTANCES[0]
    log_before = sec_cluster.cluster.procs[instance].log().count("\n")
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    try:
        order = msgspec.msgpack.encode({"pair_id": "p", "dst_instance_id": "bad.id"})
        for _ in range(200):
            await nc.publish(subjects.llumlet(instance, "migrate"), order)
        await flush_in_order(nc)
    finally:
        await nc.close()
    await asyncio.sleep(1.0)
    new_lines = sec_cluster.cluster.procs[instance].log().count("\n") - log_before
    assert new_lines <= 3, sec_cluster.cluster.procs[instance].log()[-2000:]  # rate-limited: one line, not 200
    assert sec_cluster.metric(instance, REJECTED, subject="corral.llumlet.*.migrate", reason="invalid") >= 200
    sec_cluster.assert_all_alive()


async def _streaming_request(sec_cluster, nc, max_tokens: int):
    """Start a streamed chat request; returns (the HTTP task's lines, the generate order it sent)."""
    orders: asyncio.Queue[GenerateRequest] = asyncio.Queue()

    async def on_generate(msg) -> None:
        orders.put_nowait(decode(msg.data, GenerateRequest))

    sub = await nc.subscribe(f"{subjects.PREFIX}.llumlet.*.generate", cb=on_generate)
    await flush_in_order(nc)

    async def stream() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", f"{sec_cluster.base_url}/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                return [line async for line in reply.aiter_lines() if line]

    task = asyncio.create_task(stream())
    order = await asyncio.wait_for(orders.get(), 30)
    await sub.unsubscribe()
    assert order.reply_subject == subjects.gateway_output(GATEWAY_ID)
    return task, order


def _events(lines: list[str]) -> list[dict]:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


async def test_token_chunk_with_impossible_ids_does_not_cut_the_stream(sec_cluster):
    # was: ids -1 / 2**63-1 ended the client's stream with no error and no [DONE]
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    before = sec_cluster.metric("gateway", REJECTED, subject="corral.gateway.*.out")
    try:
        task, order = await _streaming_request(sec_cluster, nc, max_tokens=40)
        for ids in ([-1], [2**63 - 1], [10**6]):  # the last decodes but lies past the vocabulary
            forged = msgspec.msgpack.encode({"request_id": order.request_id, "instance_id": "sec-0",
                                             "start_index": 1, "token_ids": ids})
            await nc.publish(order.reply_subject, forged)
        await flush_in_order(nc)
        events = _events(await asyncio.wait_for(task, 120))
    finally:
        await nc.close()
    assert not any("error" in event for event in events)
    assert events[-1]["usage"]["completion_tokens"] == 40
    assert sec_cluster.metric("gateway", REJECTED, subject="corral.gateway.*.out") == before + 3


async def test_gateway_never_delivers_more_than_max_tokens(sec_cluster):
    # was: an instance sending 1,000 tokens for max_tokens=400 got all 1,000 to the client
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    try:
        task, order = await _streaming_request(sec_cluster, nc, max_tokens=400)
        flood = TokenChunk(order.request_id, INSTANCES[0], 0, [7] * 1000)
        await nc.publish(order.reply_subject, encode(flood))
        await flush_in_order(nc)
        events = _events(await asyncio.wait_for(task, 120))
    finally:
        await nc.close()
    assert events[-1]["usage"]["completion_tokens"] == 400
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == ["length"]


async def test_out_of_order_chunk_flood_is_bounded(sec_cluster):
    # was: 200k chunks past a gap held 168 MB and stalled /healthz ~4 s
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    try:
        task, order = await _streaming_request(sec_cluster, nc, max_tokens=1500)
        for start in range(1000, 21000):  # past any gap, most past max_tokens
            await nc.publish(order.reply_subject, encode(TokenChunk(order.request_id, INSTANCES[0], start, [5])))
        await flush_in_order(nc)
        started = time.monotonic()
        assert httpx.get(f"{sec_cluster.base_url}/healthz", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0
        abort = subjects.ABORT_ALL
        await nc.publish(abort, encode_abort(order.request_id))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await nc.close()
    sec_cluster.assert_all_alive()
    assert sec_cluster.chat().status_code == 200


def encode_abort(request_id: str) -> bytes:
    from shared.messages import AbortRequest

    return encode(AbortRequest(request_id))


async def test_prealloc_top_up_goes_through_the_guard(sec_cluster):
    # was: 851 of 851 blocks reserved through a 1-block stage 0 topped up in the same stage
    instance = INSTANCES[1]
    nc = await nats.connect(sec_cluster.cluster.nats_url)
    subject = subjects.migration(instance, "prealloc")
    try:
        first = decode((await nc.request(subject, encode(PreAlloc("m-topup", "r-topup", 1, 5.0, 0)), timeout=5)).data,
                       PreAllocGrant)
        assert first.ok and len(first.block_ids) == 1
        top_up = decode((await nc.request(subject, encode(PreAlloc("m-topup", "r-topup", 851, 5.0, 0)),
                                          timeout=5)).data, PreAllocGrant)
        assert not top_up.ok and "no room" in (top_up.reason or ""), top_up
        later = decode((await nc.request(subject, encode(PreAlloc("m-topup", "r-topup", 851, 5.0, 1)),
                                         timeout=5)).data, PreAllocGrant)
        assert not later.ok
        await nc.request(subjects.migration(instance, "abort"), encode(MigrationAbort("m-topup")), timeout=5)
    finally:
        await nc.close()
    sec_cluster.assert_all_alive()
    assert sec_cluster.chat().status_code == 200
