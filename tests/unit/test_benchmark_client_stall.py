"""The migration benchmarks' client recorder (`benchmarks/client_stall.py`) finds the stall as
the gateway does: from the last new tokens before a handover chunk to the first after it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks.client_stall import _STAMP, Chunks
from shared.messages import TokenChunk, encode


def _relayed(at: float, chunk: TokenChunk) -> SimpleNamespace:
    return SimpleNamespace(data=_STAMP.pack(at) + encode(chunk))


def _feed(chunks: Chunks, *stamped: tuple[float, TokenChunk]) -> None:
    for at, chunk in stamped:
        asyncio.run(chunks.on_chunk(_relayed(at, chunk)))


def _chunk(instance: str, start: int, count: int, **extra) -> TokenChunk:
    return TokenChunk(request_id="r", instance_id=instance, start_index=start,
                      token_ids=list(range(start, start + count)), **extra)


def test_a_handover_is_timed_from_the_last_source_tokens_to_the_first_new_ones() -> None:
    chunks = Chunks()
    _feed(chunks, (1.000, _chunk("src", 0, 1)), (1.010, _chunk("src", 1, 1)), (1.020, _chunk("src", 2, 1)),
          # the destination's handover repeats the output so far, then its first step's token
          (1.040, _chunk("dst", 0, 3, handover=True, handover_from="src")), (1.050, _chunk("dst", 3, 1)),
          (1.060, _chunk("dst", 4, 1)))
    assert chunks.stalls["r"] == [pytest.approx(0.030)]
    assert chunks.handovers["r"] == [(pytest.approx(1.020), pytest.approx(1.050))]
    view = chunks.client_view("r")
    assert view["client_stall_ms"] == pytest.approx(30.0)
    assert view["own_itl_ms"] == pytest.approx(10.0)
    assert chunks.count_from("r", "dst") == 5


def test_a_handover_that_brings_new_tokens_ends_its_own_stall() -> None:
    chunks = Chunks()
    _feed(chunks, (1.000, _chunk("src", 0, 2)), (1.010, _chunk("src", 2, 1)),
          # the source's last token reaches the client only inside the destination's handover
          (1.045, _chunk("dst", 0, 4, handover=True, handover_from="src")))
    assert chunks.stalls["r"] == [pytest.approx(0.035)]


def test_a_source_that_changes_its_instance_without_a_handover_is_no_stall() -> None:
    chunks = Chunks()
    _feed(chunks, (1.000, _chunk("a", 0, 1)), (1.010, _chunk("b", 1, 1)), (1.020, _chunk("b", 2, 1)))
    assert chunks.stalls["r"] == []
    assert chunks.gaps["r"] == [pytest.approx(0.010), pytest.approx(0.010)]
