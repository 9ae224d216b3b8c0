"""The per-request output stream: ordered by token index, duplicates dropped, whatever the arrival order."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.streams import Delivery, OutputStream, StreamRegistry, TokenOrderer
from shared.messages import FinishReason, TokenChunk


def chunk(start: int, tokens: list[int], finish: FinishReason | None = None, instance: str = "a",
          error: str | None = None) -> TokenChunk:
    return TokenChunk("r1", instance, start, tokens, finish_reason=finish, error=error)


def delivered(deliveries: list[Delivery]) -> list[int]:
    return [t for d in deliveries for t in d.token_ids]


def feed_all(orderer: TokenOrderer, chunks: list[TokenChunk]) -> list[Delivery]:
    return [d for c in chunks for d in orderer.accept(c)]


def test_in_order_chunks_pass_through():
    out = feed_all(TokenOrderer(), [chunk(0, [1, 2]), chunk(2, [3]), chunk(3, [4], FinishReason.STOP)])
    assert delivered(out) == [1, 2, 3, 4]
    assert out[-1].finish_reason is FinishReason.STOP


def test_out_of_order_chunks_are_buffered_until_the_gap_fills():
    orderer = TokenOrderer()
    assert orderer.accept(chunk(2, [3, 4])) == []
    assert orderer.accept(chunk(4, [5])) == []
    out = orderer.accept(chunk(0, [1, 2]))
    assert delivered(out) == [1, 2, 3, 4, 5]
    assert orderer.next_index == 5 and not orderer.pending


def test_duplicate_chunk_is_dropped():
    orderer = TokenOrderer()
    orderer.accept(chunk(0, [1, 2]))
    assert orderer.accept(chunk(0, [1, 2], instance="b")) == []
    assert orderer.next_index == 2


def test_partially_overlapping_chunk_delivers_only_new_tokens():
    orderer = TokenOrderer()
    orderer.accept(chunk(0, [1, 2, 3]))
    out = orderer.accept(chunk(1, [2, 3, 4, 5], instance="b"))  # a migration destination resending
    assert delivered(out) == [4, 5]
    assert orderer.next_index == 5


def test_buffered_chunks_overlapping_each_other_are_merged_once():
    orderer = TokenOrderer()
    orderer.accept(chunk(2, [3, 4, 5]))
    orderer.accept(chunk(3, [4, 5, 6]))
    assert delivered(orderer.accept(chunk(0, [1, 2]))) == [1, 2, 3, 4, 5, 6]


def test_longer_chunk_at_the_same_start_replaces_a_buffered_one():
    orderer = TokenOrderer()
    orderer.accept(chunk(1, [2]))
    orderer.accept(chunk(1, [2, 3, 4]))
    orderer.accept(chunk(1, [2, 3]))
    assert delivered(orderer.accept(chunk(0, [1]))) == [1, 2, 3, 4]


def test_finish_that_arrives_before_the_gap_fills_waits_for_it():
    orderer = TokenOrderer()
    assert orderer.accept(chunk(2, [3], FinishReason.LENGTH)) == []
    assert not orderer.done
    out = orderer.accept(chunk(0, [1, 2]))
    assert delivered(out) == [1, 2, 3]
    assert out[-1].finish_reason is FinishReason.LENGTH and orderer.done


def test_finish_without_tokens_at_the_current_index_ends_the_stream():
    orderer = TokenOrderer()
    orderer.accept(chunk(0, [1]))
    out = orderer.accept(chunk(1, [], FinishReason.STOP))
    assert out == [Delivery([], FinishReason.STOP)]
    assert orderer.finish_reason is FinishReason.STOP


def test_stale_finish_from_before_the_current_index_is_ignored():
    orderer = TokenOrderer()
    orderer.accept(chunk(0, [1, 2, 3]))
    assert orderer.accept(chunk(0, [1], FinishReason.ABORT, instance="old")) == []
    assert not orderer.done


def test_nothing_is_delivered_after_the_finish():
    orderer = TokenOrderer()
    orderer.accept(chunk(0, [1], FinishReason.STOP))
    assert orderer.accept(chunk(1, [2])) == []


def test_error_chunk_ends_the_stream_even_past_a_gap():
    orderer = TokenOrderer()
    orderer.accept(chunk(0, [1]))
    orderer.accept(chunk(3, [4]))
    out = orderer.accept(chunk(5, [], error="engine crashed"))
    assert out == [Delivery([], error="engine crashed")]
    assert orderer.done and orderer.finish_reason is None


def test_error_chunk_keeps_its_in_order_tokens():
    orderer = TokenOrderer()
    out = orderer.accept(chunk(0, [1, 2], error="boom"))
    assert out == [Delivery([1, 2], error="boom")]


def test_holder_follows_the_instance_that_sends_new_tokens():
    stream = OutputStream("r1", "a")
    stream.feed(chunk(0, [1, 2], instance="a"))
    stream.feed(chunk(2, [3], instance="b"))  # migrated to b
    assert stream.holder == "b"
    stream.feed(chunk(1, [2], instance="a"))  # a late duplicate from the source
    assert stream.holder == "b"


def test_a_handover_moves_the_holder_even_without_new_tokens():
    """The destination's first chunk may repeat only what the source already sent; if the
    destination then dies, the watchdog must be watching it, not the live source."""
    stream = OutputStream("r1", "a")
    stream.feed(chunk(0, [1, 2, 3], instance="a"))
    stream.feed(TokenChunk("r1", "b", 0, [1, 2, 3], handover=True))
    assert stream.holder == "b"
    assert stream.holders == ["a", "b"]


async def test_next_keeps_each_engine_step_its_own_delivery():
    """Queued steps are not merged: the client gets one event per engine step, as from vLLM."""
    stream = OutputStream("r1", "a")
    stream.feed(chunk(0, [1]))
    stream.feed(chunk(1, [2, 3]))
    stream.feed(chunk(3, [4], FinishReason.STOP))
    assert [await stream.next(1.0) for _ in range(3)] == [
        Delivery([1]), Delivery([2, 3]), Delivery([4], FinishReason.STOP)]


async def test_fail_delivers_an_error_and_ignores_later_chunks():
    stream = OutputStream("r1", "a")
    stream.fail("instance a died", 503)
    stream.feed(chunk(0, [1]))
    assert await stream.next(1.0) == Delivery([], error="instance a died", error_code=503)
    assert stream.finished and not stream.upstream_finished


async def test_next_times_out_when_nothing_arrives():
    with pytest.raises(asyncio.TimeoutError):
        await OutputStream("r1").next(0.01)


def test_registry_routes_by_request_id_and_forgets_closed_streams():
    registry = StreamRegistry()
    stream = registry.open("r1")
    assert registry.route(chunk(0, [1]))
    assert stream.orderer.next_index == 1
    assert registry.close("r1") and not registry.close("r1")
    assert not registry.route(chunk(1, [2]))


def test_a_migration_stall_runs_from_the_last_new_token_of_one_instance_to_the_first_of_the_next(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("services.gateway.streams.time.monotonic", lambda: now[0])
    stalls: list[float] = []
    stream = StreamRegistry(on_handover_stall=stalls.append).open("r1")
    stream.feed(chunk(0, [1, 2], instance="src"))
    now[0] = 100.010
    stream.feed(chunk(2, [3], instance="src"))  # the source's last token
    now[0] = 100.015
    stream.feed(TokenChunk("r1", "dst", 0, [1, 2, 3], handover=True))  # catch-up: nothing new for the client
    now[0] = 100.020
    stream.feed(chunk(2, [3], instance="src"))  # a late duplicate from the source
    assert stalls == [] and stream.holder == "dst"
    now[0] = 100.034
    stream.feed(chunk(3, [4], instance="dst"))  # the destination's first new token
    now[0] = 100.044
    stream.feed(chunk(4, [5], instance="dst"))
    assert stalls == [pytest.approx(0.024)]


def test_a_catch_up_chunk_with_tokens_the_source_never_sent_ends_the_stall():
    stalls: list[float] = []
    stream = OutputStream("r1", "src", on_handover_stall=stalls.append)
    stream.feed(chunk(0, [1], instance="src"))
    stream.feed(TokenChunk("r1", "dst", 0, [1, 2], handover=True))  # token 2 never came from the source
    assert len(stalls) == 1 and stalls[0] >= 0


def test_the_gateway_exports_each_migration_stall():
    from services.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics("m", 2048)
    assert 'corral:gateway_migration_stall_seconds_count{model_name="m"} 0.0' in metrics.render().decode()
    stream = StreamRegistry(on_handover_stall=metrics.migration_stalled).open("r1")
    stream.feed(chunk(0, [1], instance="src"))
    stream.feed(TokenChunk("r1", "dst", 1, [2], handover=True, handover_from="src"))
    stream.feed(TokenChunk("r1", "src", 2, [3], handover=True, handover_from="dst"))  # and back
    assert 'corral:gateway_migration_stall_seconds_count{model_name="m"} 2.0' in metrics.render().decode()


def test_a_resume_is_no_migration_stall(monkeypatch):
    # was: the outage (silence detection, then the prefill again elsewhere) counted as a migration's stall
    now = [100.0]
    monkeypatch.setattr("services.gateway.streams.time.monotonic", lambda: now[0])
    stalls: list[float] = []
    stream = OutputStream("r1", "a", on_handover_stall=stalls.append)
    stream.feed(chunk(0, [1, 2], instance="a"))
    now[0] = 102.5
    stream.abandon("a")  # the holder went silent: resumed on another instance
    stream.set_holder("d")
    stream.feed(chunk(2, [3], instance="d"))
    assert stalls == [] and stream.delivered == [1, 2, 3]


def test_a_handover_that_overtook_the_sources_last_chunk_is_one_stall_and_the_source_stays_left(monkeypatch):
    # was: the delivery was credited to the source, the destination's next ordinary step taken for
    # the stall, and the source's late chunk made it the holder again
    now = [100.0]
    monkeypatch.setattr("services.gateway.streams.time.monotonic", lambda: now[0])
    stalls: list[float] = []
    stream = OutputStream("r1", "src", on_handover_stall=stalls.append)
    stream.feed(chunk(0, [1, 2, 3, 4, 5], instance="src"))
    now[0] = 100.050
    stream.feed(TokenChunk("r1", "dst", 6, [7], handover=True, handover_from="src"))  # waits behind token 6
    now[0] = 100.100
    stream.feed(chunk(5, [6], instance="src"))  # the source's last: the client gets 6 and 7 now
    assert stalls == [pytest.approx(0.100)] and stream.holder == "dst"
    now[0] = 100.110
    stream.feed(chunk(7, [8], instance="dst"))
    stream.feed(chunk(8, [9, 10], instance="src"))  # a late source chunk with tokens not yet delivered
    assert stream.holder == "dst" and stalls == [pytest.approx(0.100)]  # one migration, one stall


def test_the_cached_token_count_of_the_first_instance_stays():
    """A migration's or a resume's next instance may find more cached; the client's prompt was looked up once."""
    stream = OutputStream("r1", "a")
    stream.feed(chunk(0, [1]))
    assert stream.num_cached_tokens is None  # no first output yet: not known
    stream.feed(TokenChunk("r1", "a", 1, [2], num_cached_tokens=32))
    stream.feed(TokenChunk("r1", "b", 2, [3], num_cached_tokens=0, handover=True))
    assert stream.num_cached_tokens == 32


def test_usage_shows_cached_tokens_as_vllm_when_known():
    from services.gateway.responses import Usage

    assert Usage(10, 2).as_dict() == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    assert Usage(10, 2, cached_tokens=8).as_dict()["prompt_tokens_details"] == {"cached_tokens": 8}


def _lp(value: float):
    from shared.messages import TokenLogprob

    return TokenLogprob(value)


async def test_a_late_source_chunk_fills_in_the_logprobs_of_a_catch_up_not_yet_read():
    """The destination's catch-up (no logprobs: it never saw them) overtook the source's last
    chunk: until the client reads those tokens, the source's logprobs replace the nulls."""
    stream = OutputStream("r1", "src")
    stream.feed(TokenChunk("r1", "src", 0, [1, 2], logprobs=[_lp(-0.1), _lp(-0.2)]))
    assert (await stream.next(1.0)).logprobs == [_lp(-0.1), _lp(-0.2)]
    stream.feed(TokenChunk("r1", "dst", 0, [1, 2, 3, 4], handover=True))  # the source's 3 and 4 still in flight
    stream.feed(TokenChunk("r1", "src", 2, [3], logprobs=[_lp(-0.3)]))
    stream.feed(TokenChunk("r1", "src", 3, [4], logprobs=[_lp(-0.4)]))
    catch_up = await stream.next(1.0)
    assert catch_up.token_ids == [3, 4] and catch_up.logprobs == [_lp(-0.3), _lp(-0.4)]
    stream.feed(TokenChunk("r1", "dst", 4, [5], logprobs=[_lp(-0.5)]))
    assert (await stream.next(1.0)).logprobs == [_lp(-0.5)]


async def test_logprobs_too_late_for_a_read_catch_up_change_nothing():
    stream = OutputStream("r1", "src")
    stream.feed(TokenChunk("r1", "src", 0, [1], logprobs=[_lp(-0.1)]))
    stream.feed(TokenChunk("r1", "dst", 0, [1, 2, 3], handover=True))
    await stream.next(1.0)
    catch_up = await stream.next(1.0)  # the client has these two without logprobs already
    stream.feed(TokenChunk("r1", "src", 1, [2], logprobs=[_lp(-0.2)]))
    assert catch_up.logprobs is None and stream._unread_catch_up == []
    # A late chunk that disagrees with what was delivered (a different token) fills in nothing.
    stream.feed(TokenChunk("r1", "dst2", 3, [4], handover=True))
    stream.feed(TokenChunk("r1", "src", 3, [9], logprobs=[_lp(-0.9)]))
    assert (await stream.next(1.0)).logprobs is None


async def test_a_catch_up_filled_in_for_some_tokens_keeps_nulls_for_the_rest():
    stream = OutputStream("r1", "src")
    stream.feed(TokenChunk("r1", "dst", 0, [1, 2], handover=True))
    stream.feed(TokenChunk("r1", "src", 1, [2], logprobs=[_lp(-0.2)]))
    assert (await stream.next(1.0)).logprobs == [None, _lp(-0.2)]
