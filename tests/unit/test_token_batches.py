"""Token fan-in: one engine step's chunks of one gateway's requests in one message (TokenChunkBatch)."""

from __future__ import annotations

import asyncio
import json

import pytest

from shared.messages import FinishReason, TokenChunk, TokenChunkBatch, WireError, decode_chunks, encode
from tests.unit.gateway_nats_harness import CHAT, HELLO, OUTPUT, cluster, eventually, nats_url, text_of, tokenizer  # noqa: F401


def test_a_payload_is_one_chunk_or_a_batch_told_apart_by_its_first_byte():
    one = TokenChunk("r1", "i", 0, [1, 2])
    two = TokenChunk("r2", "i", 5, [3], finish_reason=FinishReason.STOP)
    assert decode_chunks(encode(one)) == [one]
    assert decode_chunks(encode(TokenChunkBatch([one, two]))) == [one, two]
    with pytest.raises(WireError):
        decode_chunks(encode(TokenChunkBatch([])))  # an empty batch is nobody's output
    with pytest.raises(WireError):
        decode_chunks(b"\x91\x92\x01\x02")  # an array, but not of chunks


async def test_the_gateway_splits_a_step_batch_into_its_streams(cluster, tokenizer):
    llumlet = await cluster.llumlet("batching")
    steps: dict[str, list] = {}

    def batched(request):
        # Hold each request's chunks; the third request's arrival sends every step as one batch each.
        steps[request.request_id] = llumlet.emit_all(request)
        if len(steps) == 3:
            per_step = list(zip(*steps.values()))
            llumlet._tasks.append(asyncio.create_task(_publish_steps(llumlet, request, per_step)))
        return []

    llumlet.emit = batched
    await cluster.until_alive(1)
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "n": 3, "max_tokens": 5, "stream": True})
    assert response.status_code == 200
    assert all(r.batched_output for r in llumlet.requests)
    chunks = [json.loads(e[len("data: "):]) for e in response.text.split("\n\n") if e.startswith("data: {")]
    texts: dict[int, str] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get("content", "")
    assert texts == {i: text_of(tokenizer, OUTPUT[:5]) for i in range(3)}
    await eventually(lambda: len(cluster.gateway.streams) == 0)


async def _publish_steps(llumlet, request, per_step) -> None:
    for step in per_step:
        await llumlet.nc.publish(request.reply_subject, encode(TokenChunkBatch(list(step))))
        await asyncio.sleep(0.005)
