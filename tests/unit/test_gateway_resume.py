"""Resume by recompute, without processes: what may resume, the request it continues as, and what
a stream does with the chunks around a resume."""

from __future__ import annotations

import asyncio
import time

from services.gateway.protocol import GenerationOptions, RequestKind
from services.gateway.resume import Resumer, resume_refusal, resumed_request, unresumable_state
from services.gateway.prepared import PreparedRequest
from services.gateway.streams import OutputStream
from shared.messages import FinishReason, Refusal, TokenChunk
from shared.nats_client import reconnect_wait_s, server_urls


def request(**options) -> PreparedRequest:
    return PreparedRequest(kind=RequestKind.COMPLETION, request_id="r", response_id="r", prompt_token_ids=[1, 2, 3],
                           options=GenerationOptions(**options), priority=0, max_tokens=10, arrival=0.0, created=0)


def test_what_tokens_cannot_carry_is_refused():
    assert unresumable_state(GenerationOptions(temperature=0.0)) is None
    assert unresumable_state(GenerationOptions(temperature=0.0, seed=3)) is None  # greedy: the seed draws nothing
    assert unresumable_state(GenerationOptions(temperature=0.7)) is None  # unseeded: any continuation is valid
    assert "seeded sampling" in unresumable_state(GenerationOptions(temperature=0.7, seed=3))


def test_resume_limits():
    greedy = GenerationOptions(temperature=0.0)
    assert resume_refusal(greedy, resumes=0, max_resumes=2, delivered=4, max_tokens=10) is None
    assert "limit 2" in resume_refusal(greedy, resumes=2, max_resumes=2, delivered=4, max_tokens=10)
    assert "limit 0" in resume_refusal(greedy, resumes=0, max_resumes=0, delivered=4, max_tokens=10)
    assert "every token" in resume_refusal(greedy, resumes=0, max_resumes=2, delivered=10, max_tokens=10)


def test_the_resumed_request_continues_after_the_delivered_tokens():
    original = request(temperature=0.0, min_tokens=6)
    resumed = resumed_request(original, [7, 8, 9, 10])
    assert resumed.prompt_token_ids == [1, 2, 3, 7, 8, 9, 10]
    assert resumed.max_tokens == 6 and resumed.options.min_tokens == 2
    assert resumed.request_id == original.request_id  # the same stream, the same engine request id
    assert original.prompt_token_ids == [1, 2, 3]


def chunk(start, tokens, instance="a", **kw) -> TokenChunk:
    return TokenChunk("r", instance, start, tokens, **kw)


def drain(stream: OutputStream) -> list:
    out = []
    while not stream._queue.empty():
        out.append(stream._queue.get_nowait())
    return out


async def test_a_resume_continues_the_stream_and_drops_the_instance_left():
    placed = []

    async def place(req, stream, exclude, resume_from):
        placed.append((req.prompt_token_ids, exclude, resume_from))
        stream.set_holder("b")

    tasks = []
    resumer = Resumer(place, max_resumes=2, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)))
    stream = OutputStream("r", "a", on_lost=resumer.lost)
    resumer.track(request(temperature=0.0))
    stream.feed(chunk(0, [7, 8]))
    stream.feed(chunk(3, [10]))  # past a gap: held
    assert stream.gap_since is not None
    resumer.lost(stream, "a", "instance a stopped reporting")
    await asyncio.gather(*tasks)
    assert placed == [([1, 2, 3, 7, 8], ["a"], 2)]
    assert stream.holder == "b" and stream.resumes == 1 and stream.gap_since is None
    stream.feed(chunk(2, [99], instance="a"))  # late, from the instance left: dropped
    stream.feed(chunk(2, [9, 10], instance="b"))
    stream.feed(chunk(4, [11], instance="b", finish_reason=FinishReason.LENGTH))
    deliveries = drain(stream)
    assert [t for d in deliveries for t in d.token_ids] == [7, 8, 9, 10, 11]
    assert deliveries[-1].finish_reason is FinishReason.LENGTH and not any(d.error for d in deliveries)


async def test_a_resumable_error_from_the_holder_resumes_and_seeded_sampling_fails_cleanly():
    tasks = []

    async def place(req, stream, exclude, resume_from):
        raise AssertionError("must not be placed")

    resumer = Resumer(place, max_resumes=2, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)))
    stream = OutputStream("r", "a", on_lost=resumer.lost)
    resumer.track(request(temperature=0.9, seed=1))
    stream.feed(chunk(0, [7]))
    stream.feed(chunk(0, [], error="instance stopped (a)", finish_reason=FinishReason.ERROR, resumable=True))
    deliveries = drain(stream)
    assert deliveries[-1].error and "seeded sampling" in deliveries[-1].error and stream.finished
    assert not tasks


def test_nats_urls_and_reconnect_backoff():
    assert server_urls("nats://a:4222, nats://b:4222,") == ["nats://a:4222", "nats://b:4222"]
    assert reconnect_wait_s(0) == 0.0  # a server not failed lately: at once (a cluster node gone)
    waits = [reconnect_wait_s(n) for n in range(1, 12)]
    assert all(0.05 <= w <= 1.5 for w in waits) and max(waits) > 0.5
    # A server down for hours: the wait stays at the cap (0.1 * 2**1024 once overflowed, and the
    # exception made nats-py retry at once, logging ~40 GB in two hours).
    assert all(0.5 <= reconnect_wait_s(n) <= 1.5 for n in (1_025, 10**6))


async def test_a_resume_refused_for_want_of_room_tries_again_but_not_with_no_instance_left(monkeypatch):
    from services.gateway import resume as resume_module
    from services.gateway.errors import ApiError

    monkeypatch.setattr(resume_module, "RESUME_PATIENCE_S", 0.3)
    monkeypatch.setattr(resume_module, "RESUME_RETRY_S", 0.05)
    tries = []

    async def place(req, stream, exclude, resume_from):
        tries.append(resume_from)
        if len(tries) < 3:
            raise ApiError(503, "all instances are busy", reason=Refusal.OVERLOADED)
        stream.set_holder("b")

    tasks = []
    resumer = Resumer(place, max_resumes=2, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)))
    stream = OutputStream("r", "a", on_lost=resumer.lost)
    resumer.track(request(temperature=0.0))
    stream.feed(chunk(0, [7]))
    resumer.lost(stream, "a", "instance a stopped reporting")
    await asyncio.gather(*tasks)
    assert tries == [1, 1, 1] and stream.holder == "b" and not stream.finished

    async def never(req, stream, exclude, resume_from):
        raise ApiError(503, "no instance is available", reason=Refusal.NO_INSTANCE)  # none left: at once

    resumer = Resumer(never, max_resumes=2, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)))
    stream = OutputStream("r", "a", on_lost=resumer.lost)
    resumer.track(request(temperature=0.0))
    started = time.monotonic()
    resumer.lost(stream, "a", "instance a stopped reporting")
    await asyncio.gather(*tasks)
    assert stream.finished and "no instance is available" in drain(stream)[-1].error
    assert time.monotonic() - started < 0.2  # not the 0.3 s of patience
