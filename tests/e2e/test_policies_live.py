"""Corral's policies in the live services: real scheduler, llumlets (simulated engine) and gateway
processes over a NATS server of each test's own.

- De-fragmentation: a long prompt that fits no single instance's free blocks, though the cluster
  has room, is placed once migration moves a resident away, much sooner than without migration.
- Priorities: under load, high-priority requests see a lower TTFT and a lower TPOT than normal
  ones. The load is one where admitted requests outgrow memory (short prompts, long outputs):
  the llumlets' priority queues admit high-priority requests first (and preempt normal ones to
  make room), and when a running request needs a block the victim is the least important one, so
  normal requests absorb the preemption stalls. (Execution-priority headroom adds little to TPOT
  here: with 160-block instances the decode step is nearly all fixed cost, and both instances
  hold high-priority requests; in the 16-instance simulator it lowers normal requests' share on
  those instances.)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest

from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import decode_chunks
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver

PROMPT_TOKEN = 100  # any id the tiny model's vocabulary has: prompts are sent as token ids

# -- de-fragmentation scenario (block size 16) --------------------------------------------------
# Two instances of 128 blocks, two residents each: 400-token prompts (25 blocks) decoding 200
# tokens (+13 blocks) at the A10's real speed (~30 ms a step: a resident lives ~6 s). When the
# long prompt arrives each instance has ~74 blocks free and the cluster ~148; the long prompt needs
# 85. Its instance's head-of-line freeness is (128 - 54 - 85) / 2 < 1 (a source); the other's is
# ~37 (> 10, no queue: a destination). Moving one resident frees ~27 blocks: the prompt fits.
# Without migration it waits until a resident on its instance finishes. Peak use after the move
# stays below 128 on both (3 x 38 and 38 + 85 + 1), so nothing is preempted.
DEFRAG_LLUMLET = ("--sim-num-blocks", "128", "--sim-time-scale", "1.0", "--max-model-len", "2048",
                  "--report-interval-s", "0.05")
RESIDENT_PROMPT_TOKENS = 399  # + 1 → 25 blocks of demand
RESIDENT_MAX_TOKENS = 200
LONG_PROMPT_TOKENS = 1350
LONG_PROMPT_BLOCKS = 85  # its demand: the prompt plus the first token, in blocks of 16
# A request may move only after a second on its instance (MigrationGuard.min_residence_s).
RESIDENCE_S = 1.3

# -- priority scenario -------------------------------------------------------------------------
PRIORITY_LLUMLET = ("--sim-num-blocks", "160", "--sim-time-scale", "0.3", "--max-model-len", "2048",
                    "--sim-queue-policy", "priority", "--report-interval-s", "0.05")
NUM_NORMAL, NUM_HIGH = 60, 10
LOAD_PROMPT_TOKENS = 100  # 7 blocks at admission, 26 at the end: admitted requests outgrow memory
LOAD_MAX_TOKENS = 300


@dataclass
class Timing:
    ttft_s: float
    tpot_s: float
    completion_tokens: int


class LiveCluster:
    """NATS plus a Cluster, started and stopped together; also records what crosses NATS: load
    reports, migrate orders and which instance published each request's tokens."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.server = start_nats()
        self.cluster = Cluster(self.server.url, model_dir, log_dir)
        self.migrate_orders = 0
        self.publishers: dict[str, list[str]] = defaultdict(list)

    async def start(self, scheduler_args: tuple[str, ...], llumlet_args: tuple[str, ...], instances: int) -> None:
        self.cluster.start_scheduler(*scheduler_args)
        for i in range(instances):
            self.cluster.start_llumlet(f"live-{i}", *llumlet_args)
        self.cluster.start_gateway()
        self.observer = await NatsObserver(self.server.url).__aenter__()
        self.nc = await nats.connect(self.server.url)
        await self.nc.subscribe(f"{subjects.PREFIX}.llumlet.*.migrate", cb=self._on_migrate)
        await self.nc.subscribe(f"{subjects.PREFIX}.gateway.*.out", cb=self._on_chunk)
        await asyncio.to_thread(self.cluster.wait_ready, instances)
        ids = [f"live-{i}" for i in range(instances)]
        assert await self.observer.wait_for(lambda latest: all(i in latest and latest[i].kv_address for i in ids), 30)
        async with httpx.AsyncClient(base_url=self.cluster.base_url, timeout=10) as http:
            self.model = (await http.get("/v1/models")).json()["data"][0]["id"]

    async def _on_migrate(self, msg) -> None:
        self.migrate_orders += 1

    async def _on_chunk(self, msg) -> None:
        for chunk in decode_chunks(msg.data):  # one chunk, or a step's batch of them
            seen = self.publishers[chunk.request_id]
            if chunk.token_ids and (not seen or seen[-1] != chunk.instance_id):
                seen.append(chunk.instance_id)

    async def stop(self) -> None:
        if hasattr(self, "nc"):
            await self.nc.close()
        if hasattr(self, "observer"):
            await self.observer.__aexit__(None, None, None)
        self.cluster.stop()
        self.server.stop()


async def stream_completion(http: httpx.AsyncClient, model: str, prompt_tokens: int, max_tokens: int,
                            priority: int = 0) -> Timing:
    """One streamed completion; TTFT is the time to the first event carrying a choice."""
    body = {"model": model, "prompt": [PROMPT_TOKEN] * prompt_tokens, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "priority": priority}
    start = time.monotonic()
    first = None
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        pending = b""
        async for data in reply.aiter_bytes():
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                line = line.rstrip(b"\r").decode()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("choices") and first is None:
                    first = time.monotonic()
                usage = event.get("usage") or usage
    end = time.monotonic()
    assert first is not None and usage is not None
    n = usage["completion_tokens"]
    assert n == max_tokens, usage
    ttft = first - start
    return Timing(ttft, (end - first) / (n - 1) if n > 1 else 0.0, n)


async def long_prompt_ttft(model_dir: Path, log_dir: Path, migration: bool) -> tuple[float, LiveCluster]:
    log_dir.mkdir(parents=True, exist_ok=True)
    live = LiveCluster(model_dir, log_dir)
    try:
        scheduler = ("--migration-interval-s", "0.1") if migration else ("--no-enable-migration",)
        await live.start(scheduler, DEFRAG_LLUMLET, instances=2)
        async with httpx.AsyncClient(base_url=live.cluster.base_url, timeout=60) as http:
            residents = []
            for _ in range(4):
                residents.append(asyncio.create_task(
                    stream_completion(http, live.model, RESIDENT_PROMPT_TOKENS, RESIDENT_MAX_TOKENS)))
                await asyncio.sleep(0.15)
            two_each = await live.observer.wait_for(
                lambda latest: [latest[i].num_running for i in ("live-0", "live-1")] == [2, 2], 5)
            assert two_each, {i: (r.num_running, r.num_waiting) for i, r in live.observer.latest.items()}
            await asyncio.sleep(RESIDENCE_S)
            latest = live.observer.latest.values()
            assert all(r.num_blocks_free < LONG_PROMPT_BLOCKS for r in latest), "no fragmentation"
            assert sum(r.num_blocks_free for r in latest) > LONG_PROMPT_BLOCKS, "the cluster has no room"
            ttft = (await stream_completion(http, live.model, LONG_PROMPT_TOKENS, 4)).ttft_s
            await asyncio.gather(*residents)
        return ttft, live
    finally:
        await live.stop()


@pytest.mark.slow
async def test_migration_places_a_long_prompt_that_fits_no_single_instance(tiny_model_dir, tmp_path):
    """The same scenario twice: scheduler migration off, then on."""
    without_ttft, without = await long_prompt_ttft(tiny_model_dir, tmp_path / "without", migration=False)
    with_ttft, with_ = await long_prompt_ttft(tiny_model_dir, tmp_path / "with", migration=True)
    print(f"long prompt TTFT: {with_ttft:.2f} s with migration, {without_ttft:.2f} s without")
    assert without.migrate_orders == 0
    assert with_.migrate_orders > 0
    moved = [rid for rid, seen in with_.publishers.items() if len(seen) > 1]
    assert moved, "no request changed instance"
    # Without migration it waits for a resident (~6 s of decoding, ~4.5 s left); with it, one
    # migration round and the copy of ~27 blocks.
    assert without_ttft > 2.5, without_ttft
    assert with_ttft < 0.5 * without_ttft, (with_ttft, without_ttft)


@pytest.mark.slow
async def test_high_priority_requests_see_lower_ttft_and_tpot_under_load(tiny_model_dir, tmp_path):
    """High-priority requests jump the llumlets' queues and are never the preemption victims."""
    live = LiveCluster(tiny_model_dir, tmp_path)
    try:
        await live.start(("--migration-interval-s", "0.1"), PRIORITY_LLUMLET, instances=2)
        async with httpx.AsyncClient(base_url=live.cluster.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=200)) as http:

            async def one(i: int, priority: int) -> tuple[int, Timing]:
                await asyncio.sleep(i * 0.02)
                return priority, await stream_completion(http, live.model, LOAD_PROMPT_TOKENS, LOAD_MAX_TOKENS, priority)

            # High-priority requests interleaved in the second half, once queues have formed.
            order = [0] * NUM_NORMAL
            for k in range(NUM_HIGH):
                order.insert(NUM_NORMAL // 3 + k * 5, -1)
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(order)))
        high = [t for p, t in results if p == -1]
        normal = [t for p, t in results if p == 0]
        high_ttft, normal_ttft = statistics.mean(t.ttft_s for t in high), statistics.mean(t.ttft_s for t in normal)
        high_tpot, normal_tpot = statistics.mean(t.tpot_s for t in high), statistics.mean(t.tpot_s for t in normal)
        print(f"TTFT high {high_ttft:.3f} s normal {normal_ttft:.3f} s; "
              f"TPOT high {high_tpot * 1000:.1f} ms normal {normal_tpot * 1000:.1f} ms")
        assert high_ttft < 0.5 * normal_ttft, (high_ttft, normal_ttft)
        # Simulated 0.65x, measured 0.63x: the margin leaves room for a loaded 2-core machine.
        assert high_tpot < 0.8 * normal_tpot, (high_tpot, normal_tpot)
    finally:
        await live.stop()
