"""The raw loopback baseline the migration benchmarks compare the KV transfer with
(benchmarks/migration_sim.py, shared by benchmarks/migration_vllm.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from benchmarks.migration_sim import BACKGROUND_PROMPT, BACKGROUND_REQUESTS, Settings, warm_up_plan
from benchmarks.raw_loopback import RawLoopback, _RawSink, beside_raw_copies, transfer_vs_raw
from services.llumlet.migration.protocol import MigrationLimits


async def _sink_server() -> tuple[asyncio.Server, list[_RawSink]]:
    sinks: list[_RawSink] = []

    def factory() -> _RawSink:
        sinks.append(_RawSink())
        return sinks[-1]

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    return server, sinks


async def test_raw_sink_takes_copies_of_any_size_whole() -> None:
    server, sinks = await _sink_server()
    port = server.sockets[0].getsockname()[1]
    small, large = RawLoopback(3 << 10, port), RawLoopback(5 << 20, port)
    try:
        for link in (small, large):
            await link.start()  # (one copy)
            assert await link.copy() > 0
        assert [len(sink.buffer) for sink in sinks] == [3 << 10, 5 << 20]
        assert all(bytes(sink.buffer[-16:]) == b"\x5a" * 16 for sink in sinks)
        assert all(sink.got == 0 for sink in sinks)  # each copy answered once it was whole, none pending
    finally:
        small.close()
        large.close()
        server.close()


class _FakeLink:
    def __init__(self, name: str, log: list[str], gbps: list[float]) -> None:
        self.name, self.log, self.gbps = name, log, gbps

    async def copy(self) -> float:
        self.log.append(self.name)
        return self.gbps.pop(0)


async def test_raw_copies_right_before_and_after_the_migration() -> None:
    log: list[str] = []
    links = {"in_destination": _FakeLink("dst", log, [2.0, 4.0]), "own_process": _FakeLink("own", log, [3.0, 1.0])}

    async def migrate() -> dict:
        log.append("migration")
        return {"first_stage_gbps": 2.4}

    row = await beside_raw_copies(links, migrate())
    assert log == ["dst", "own", "migration", "own", "dst"]
    assert row["raw_loopback_gbps"] == {"in_destination": [2.0, 4.0], "own_process": [3.0, 1.0]}


def test_transfer_against_the_mean_of_its_two_raw_copies() -> None:
    rows = [{"first_stage_gbps": gbps, "raw_loopback_gbps": {"in_destination": raw}}
            for gbps, raw in ((1.5, [1.0, 2.0]), (3.0, [2.0, 4.0]), (None, [1.0, 1.0]))]
    ratio = transfer_vs_raw(rows)["in_destination"]
    assert ratio["runs"] == pytest.approx([1.0, 1.0, 0.0])
    assert (ratio["median"], ratio["min"], ratio["max"]) == pytest.approx((1.0, 0.0, 1.0))
    assert ratio["strict_median"] == pytest.approx(0.75)  # 1.5 / 2, 3 / 4, 0
    assert ratio["raw_gbps"] == {"median": 1.5, "min": 1.0, "max": 4.0}


def _settings(lengths: list[int], **overrides) -> Settings:
    return Settings(MigrationLimits(), lengths, 32768, 1, **{"num_blocks": 2048, "block_size": 16,
                    "max_model_len": 16384, "gpu": "A10", "out": Path("unused.json"), **overrides})


@pytest.mark.parametrize("lengths", [[256], [1024], [256, 8192], [12000]])
def test_warm_up_fits_under_the_destinations_free_block_guard(lengths: list[int]) -> None:
    s = _settings(lengths)
    length, count = warm_up_plan(s)
    assert length >= max(lengths) and length + 1000 <= s.max_model_len
    assert count >= 1
    per_request = -(-(length + 256) // s.block_size)
    background = BACKGROUND_REQUESTS * BACKGROUND_PROMPT // s.block_size
    free_after = s.num_blocks - background - count * per_request
    assert free_after >= s.num_blocks * s.limits.dest_min_free_fraction + background  # (background growth too)


def test_warm_up_length_stays_under_a_short_model_len() -> None:
    s = dataclasses.replace(_settings([256]), max_model_len=2000)
    assert warm_up_plan(s)[0] == 1000
