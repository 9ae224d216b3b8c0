"""A stream holds at most `max_buffered` deliveries for a slow client: past it, what waits is
dropped and the stream ends with an error at once (no queue that grows with the engine)."""

from __future__ import annotations

from services.gateway.streams import OutputStream
from shared.messages import FinishReason, TokenChunk


def chunk(start: int, finish: FinishReason | None = None) -> TokenChunk:
    return TokenChunk("r", "a", start, [7], finish_reason=finish)


async def test_a_client_that_keeps_up_is_never_cut():
    stream = OutputStream("r", "a", max_buffered=4)
    for i in range(100):
        stream.feed(chunk(i))
        assert (await stream.next(1.0)).token_ids == [7]
    assert not stream.finished


async def test_a_slow_client_gets_an_error_once_the_bound_is_passed_and_nothing_more_queues():
    stream = OutputStream("r", "a", max_buffered=4)
    for i in range(4):
        stream.feed(chunk(i))
    assert not stream.finished
    stream.feed(chunk(4))
    assert stream.finished and not stream.upstream_finished  # the handler will abort upstream
    for i in range(5, 50):
        stream.feed(chunk(i))
    first = await stream.next(1.0)
    assert first.error and "too slowly" in first.error and first.token_ids == []
    assert stream._queue.empty()


async def test_the_final_delivery_may_wait_past_the_bound():
    stream = OutputStream("r", "a", max_buffered=2)
    stream.feed(chunk(0))
    stream.feed(chunk(1))
    stream.feed(chunk(2, FinishReason.LENGTH))
    deliveries = [await stream.next(1.0) for _ in range(3)]
    assert deliveries[-1].finish_reason is FinishReason.LENGTH and all(d.error is None for d in deliveries)
