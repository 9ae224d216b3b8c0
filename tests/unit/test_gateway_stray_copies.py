"""A resume can leave a second copy of a request running: its holder was taken for dead while
alive (its reports late under load), or a migration out of it committed after the resume. The
gateway drops that copy's output and tells that one instance alone to drop the request (an
`AbortRequest` with `instance_id`); a copy a placement then adopts (the resume found the request
there already) is the holder, not a stray."""

from __future__ import annotations

import asyncio

import nats

from services.gateway.streams import OutputStream
from shared import subjects
from shared.messages import AbortRequest, FinishReason, TokenChunk, encode
from tests.unit.test_llumlet_refusals import gen, llumlet, order  # noqa: F401 (the llumlet fixture)


def chunk(instance: str, start: int, tokens: list[int], **fields) -> TokenChunk:
    return TokenChunk("r", instance, start, tokens, **fields)


def resumed_stream() -> tuple[OutputStream, list[str]]:
    """A stream that got 2 tokens from `a`, lost it, and was resumed on `c`."""
    told: list[str] = []
    stream = OutputStream("r", "a", on_stray=lambda s, instance: told.append(instance))
    stream.feed(chunk("a", 0, [1, 2]))
    stream.abandon("a")
    stream.set_holder("c")
    return stream, told


def test_a_left_instance_that_still_runs_its_copy_is_told_to_drop_it_once():
    stream, told = resumed_stream()
    stream.feed(chunk("c", 2, [3]))
    stream.feed(chunk("a", 2, [9]))  # taken for dead, alive: its copy decodes on
    stream.feed(chunk("a", 3, [9]))
    assert told == ["a"] and stream.delivered == [1, 2, 3] and stream.holder == "c"


def test_a_migration_out_of_a_left_instance_committed_late_is_a_second_copy():
    stream, told = resumed_stream()
    stream.feed(chunk("b", 0, [1, 2], handover=True, handover_from="a"))
    stream.feed(chunk("b", 2, [7]))
    stream.feed(chunk("c", 2, [3]))
    assert told == ["b"] and stream.holder == "c" and stream.delivered == [1, 2, 3] and "b" in stream.left


def test_a_migration_out_of_the_holder_is_a_handover():
    stream, told = resumed_stream()
    stream.feed(chunk("c", 2, [3]))
    stream.feed(chunk("d", 2, [3, 4], handover=True, handover_from="c"))
    assert told == [] and stream.holder == "d" and stream.delivered == [1, 2, 3, 4]


async def test_a_late_copy_seen_while_a_placement_runs_is_kept_until_it_decides():
    told: list[str] = []
    stream = OutputStream("r", "a", on_stray=lambda s, instance: told.append(instance))
    stream.feed(chunk("a", 0, [1, 2]))
    stream.abandon("a")
    async with stream.placing:  # the resume is placing the request: it may land on `b`, holding it already
        stream.feed(chunk("b", 0, [1, 2], handover=True, handover_from="a"))
        assert told == [] and stream.holder == "a"
        stream.set_holder("b")  # (what `_place` does when `b` refuses the resume as a duplicate)
    stream.feed(chunk("b", 2, [3]))
    assert told == [] and stream.delivered == [1, 2, 3]


def test_a_left_copys_last_chunk_asks_nothing():
    stream, told = resumed_stream()
    stream.feed(chunk("a", 2, [9], finish_reason=FinishReason.LENGTH))
    assert told == [] and not stream.finished


async def test_an_abort_for_one_instance_leaves_the_others_copies_alone(nats_url, llumlet):  # noqa: F811
    nc = await nats.connect(nats_url)
    try:
        for request_id in ("kept", "dropped"):
            assert (await order(nc, llumlet, encode(gen(request_id, 20, 2000)))).ok
        await nc.publish(subjects.ABORT_ALL, encode(AbortRequest("kept", "a copy elsewhere", instance_id="other")))
        await nc.publish(subjects.ABORT_ALL, encode(AbortRequest("dropped", "a copy here",
                                                                 instance_id=llumlet.instance_id)))
        for _ in range(250):
            if "dropped" not in llumlet.routes:
                break
            await asyncio.sleep(0.02)
        assert "dropped" not in llumlet.routes and "kept" in llumlet.routes  # (the two went out in order)
    finally:
        await nc.close()
