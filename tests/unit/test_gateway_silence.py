"""Streams that fall silent with their instance alive (issue 14 §5: a lost chunk ends within
seconds, not after the 600 s inactivity timeout), and a resume that finds its request already
running where it lands (a migration that got there first: kept, not a 409) or set off while the
request is still being placed (waits for that placement: not a 409). Scripted llumlets on
a real nats-server, as in test_gateway_nats (gateway_nats_harness)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.gateway import resume
from services.gateway.resume import SILENCE_PROBE_MAX_S, silence_probe_due
from shared import subjects
from shared.messages import Ack, DispatchReply, FinishReason, GenerateRequest, Refusal, TokenChunk, decode, encode
from tests.unit.gateway_nats_harness import (  # noqa: F401 (fixtures)
    CHAT, HELLO, OUTPUT, FakeLlumlet, cluster, eventually, nats_url, text_of, tokenizer,
)

PROBE_S = 0.3


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch):
    monkeypatch.setattr(resume, "SILENCE_PROBE_S", PROBE_S)


class HoldingLlumlet(FakeLlumlet):
    """Refuses a request id it still holds as a duplicate, as the llumlet does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: set[str] = set()
        self.refused: list[GenerateRequest] = []

    async def _on_generate(self, msg) -> None:
        request = decode(msg.data, GenerateRequest)
        if request.request_id in self.held:
            self.refused.append(request)
            await msg.respond(encode(Ack(ok=False, error="already running here", reason=Refusal.DUPLICATE)))
            return
        await super()._on_generate(msg)


def events_of(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def content(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if "choices" in e)


def test_the_holder_is_asked_after_the_first_silence_then_less_and_less_often():
    assert not silence_probe_due(PROBE_S * 0.9, probes=0) and silence_probe_due(PROBE_S, probes=0)
    assert not silence_probe_due(PROBE_S * 1.5, probes=1) and silence_probe_due(PROBE_S * 2, probes=1)
    assert silence_probe_due(SILENCE_PROBE_MAX_S, probes=2_000)  # hours silent: still the cap, no overflow
    assert silence_probe_due(resume.SILENCE_PROBE_MAX_S, probes=30)  # never later than the cap


async def test_a_lost_last_chunk_is_noticed_and_the_request_continues_where_it_stands(cluster, tokenizer):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)

    def lose_the_last_chunk(request: GenerateRequest):
        if request.resume_from == 0:  # every chunk but the last, which carried the end
            return [llumlet.chunk(request, i, [t]) for i, t in enumerate(OUTPUT[:-1])]
        # The instance no longer held it, took the continuation, and ends it.
        assert request.prompt_token_ids[-request.resume_from:] == OUTPUT[:-1]
        return [llumlet.chunk(request, request.resume_from, OUTPUT[-1:], FinishReason.STOP)]

    llumlet.emit = lose_the_last_chunk
    started = time.monotonic()
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    took = time.monotonic() - started
    events = events_of(response.text)
    assert not any("error" in e for e in events), events[-1]
    assert content(events) == text_of(tokenizer, OUTPUT) and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert [r.resume_from for r in llumlet.requests] == [0, len(OUTPUT) - 1]
    assert took < PROBE_S + 2.0  # not the inactivity timeout (5 s here, 600 s by default)


async def test_a_quiet_request_its_instance_still_holds_is_left_to_run(cluster, tokenizer):
    llumlet = HoldingLlumlet(cluster.nc, "quiet-a")
    await llumlet.start()
    cluster.llumlets.append(llumlet)
    await cluster.until_alive(1)

    def queued_for_a_while(request: GenerateRequest):
        llumlet.held.add(request.request_id)
        return [llumlet.chunk(request, 0, OUTPUT[:2]), 1.5,  # (preempted, say: 5 probe periods)
                llumlet.chunk(request, 2, OUTPUT[2:], FinishReason.STOP)]

    llumlet.emit = queued_for_a_while
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    events = events_of(response.text)
    assert not any("error" in e for e in events), events[-1]
    assert content(events) == text_of(tokenizer, OUTPUT)
    assert 1 <= len(llumlet.refused) <= 3  # asked at 0.3, 0.6, 1.2 s: "already running here" each time
    assert len(llumlet.requests) == 1 and not llumlet.aborts


async def test_a_silent_stream_that_cannot_be_resumed_ends_with_an_error_at_once(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.emit = lambda request: ([llumlet.chunk(request, 0, OUTPUT[:3])] if request.resume_from == 0 else [])
    started = time.monotonic()
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True, "temperature": 0.8,
                                                     "seed": 7})
    assert time.monotonic() - started < PROBE_S + 2.0
    error = [e for e in events_of(response.text) if "error" in e][-1]["error"]
    assert error["code"] == 503 and "seeded sampling" in error["message"]
    # The continuation it took to find out must not run: aborted.
    await eventually(lambda: llumlet.requests[0].request_id in llumlet.aborts)


async def test_a_resume_landing_where_a_migration_took_the_request_keeps_it_there(cluster, tokenizer):
    """The 409 once seen: the holder died as its migration committed on another instance; the
    resume chose that instance, which refused the id as a duplicate. It holds the request: the
    stream goes on with its chunks."""
    source = await cluster.llumlet("src")
    destination = HoldingLlumlet(cluster.nc, "dst-holding")
    await destination.start()
    cluster.llumlets.append(destination)
    chosen = iter([source.instance_id, destination.instance_id])
    await cluster.scheduler(lambda request: DispatchReply(instance_id=next(chosen)))
    await cluster.until_alive(2)

    def migrate_then_die(request: GenerateRequest):
        destination.held.add(request.request_id)  # the migration committed there
        source.reporting = False  # and the source died
        destination._tasks.append(asyncio.create_task(destination._stream(request, [
            1.5,  # its first chunk comes after the gateway saw the source die and resumed
            destination.chunk(request, 2, OUTPUT[2:], FinishReason.STOP)])))
        return [source.chunk(request, 0, OUTPUT[:2])]

    source.emit = migrate_then_die
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    events = events_of(response.text)
    assert not any("error" in e for e in events), events[-1]
    assert content(events) == text_of(tokenizer, OUTPUT)
    assert len(destination.refused) >= 1 and destination.refused[0].resume_from == 2


async def test_a_resume_set_off_while_the_request_is_still_being_placed_waits_for_that_placement(cluster, tokenizer):
    """The 409 seen in the soak: the instance first chosen gave the request up at once (a
    resumable error: it took the gateway for gone) and died before acknowledging. The resume
    that error set off and the placement moving on from the dead instance both sent the id to
    the next instance; the second was refused as a duplicate and the client got a 409. Now the
    resume waits for the placement, finds the request placed, and leaves it there."""
    dying = await cluster.llumlet("dying")
    survivor = HoldingLlumlet(cluster.nc, "survivor")
    await survivor.start()
    cluster.llumlets.append(survivor)
    await cluster.until_alive(2)
    await cluster.scheduler(lambda request: DispatchReply(
        instance_id=survivor.instance_id if dying.instance_id in request.exclude else dying.instance_id))

    async def give_up_and_die(msg) -> None:
        request = decode(msg.data, GenerateRequest)
        dying.requests.append(request)
        dying.reporting = False  # dies before acknowledging (and never does)
        await cluster.nc.publish(request.reply_subject, encode(TokenChunk(
            request.request_id, dying.instance_id, 0, [], finish_reason=FinishReason.ERROR,
            error="gateway went silent: request aborted", resumable=True)))

    await dying._subs.pop(0).unsubscribe()
    dying._subs.append(await cluster.nc.subscribe(subjects.llumlet(dying.instance_id, "generate"),
                                                  cb=give_up_and_die))

    def hold(request: GenerateRequest):
        survivor.held.add(request.request_id)
        return survivor.emit_all(request)

    survivor.emit = hold
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    assert response.status_code == 200, response.text
    events = events_of(response.text)
    assert not any("error" in e for e in events), events[-1]
    assert content(events) == text_of(tokenizer, OUTPUT)
    assert len(survivor.requests) == 1 and not survivor.refused  # sent there once
