"""NATS killed under load, then back: every service reconnects by itself, requests in the gap get
a fast 503 with Retry-After, requests succeed again within 5 s of NATS' return, and each stream
in flight completes with the right output or ends with an error its client sees: none hangs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from shared.embedded_nats import start_nats
from tests.chaos.harness import (
    GenerateLog, dead_processes, judge, log_lines, model_name, stream_completion, wait_blocks_back,
)
from tests.chaos.test_instance_death import expected, prompts

STREAMS = 12
TOKENS = 300


async def _first_success_after(http: httpx.AsyncClient, name: str, started: float, limit_s: float) -> float:
    """Seconds from `started` until a request succeeds again (polling)."""
    while time.monotonic() - started < limit_s:
        reply = await http.post("/v1/completions", json={"model": name, "prompt": [5, 6, 7], "max_tokens": 4})
        if reply.status_code == 200:
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(f"no request succeeded within {limit_s} s of NATS coming back")


async def _all_reconnected(cluster, timeout_s: float = 5.0) -> list[str]:
    """The processes that have not said they reconnected to NATS (empty: all have)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [name for name in cluster.procs if not log_lines(cluster, name, "reconnected to NATS")]
        if not missing or time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.2)


async def _outage(make_cluster, chaos_nats, tiny_model_dir, outage_s: float, gateway_args: tuple[str, ...] = ()):
    cluster = make_cluster(3, gateway_args=gateway_args)
    name = model_name(cluster)
    port = chaos_nats.port
    revived = None
    async with GenerateLog(cluster.nats_url) as orders:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            streams = [asyncio.create_task(stream_completion(http, name, p, TOKENS)) for p in prompts(STREAMS)]
            await asyncio.sleep(1.0)  # mid-decode
            chaos_nats.stop()
            try:
                await asyncio.sleep(0.5)
                gap = []
                for _ in range(5):
                    sent = time.monotonic()
                    reply = await http.post("/v1/completions", json={"model": name, "prompt": [5, 6], "max_tokens": 4})
                    gap.append((reply.status_code, reply.headers.get("retry-after"), time.monotonic() - sent))
                await asyncio.sleep(max(0.0, outage_s - 0.5 - sum(g[2] for g in gap)))
                assert dead_processes(cluster) == [], "a service gave up while NATS was away"
            finally:
                revived = start_nats(port=port)
            back = time.monotonic()
            try:
                recovery_s = await _first_success_after(http, name, back, 5.0)
                outcomes = await asyncio.gather(*streams)
            except BaseException:
                revived.stop()
                raise
    return cluster, orders, outcomes, gap, recovery_s, revived


async def test_nats_down_5_s_then_back(make_cluster, chaos_nats, tiny_model_dir):
    cluster, orders, outcomes, gap, recovery_s, revived = await _outage(make_cluster, chaos_nats, tiny_model_dir, 5.0)
    try:
        texts = expected(tiny_model_dir, orders, prompts(STREAMS), TOKENS)
        tally = judge(outcomes, texts)
        print(f"\nNATS down 5 s: in flight {tally.line()}; during the gap {gap}; success again "
              f"{recovery_s:.2f} s after NATS returned")
        assert tally.hung == 0 and tally.wrong == 0, tally
        assert all(status == 503 and retry == "1" and took < 1.0 for status, retry, took in gap), gap
        assert recovery_s < 5.0
        assert await _all_reconnected(cluster) == []
        assert not (left := await wait_blocks_back(cluster.nats_url, ["sim-0", "sim-1", "sim-2"])), left
        assert dead_processes(cluster) == []
    finally:
        cluster.stop()
        revived.stop()


async def _long_outage(make_cluster, chaos_nats, tiny_model_dir, outage_s: float, fail_s: float):
    cluster, orders, outcomes, gap, recovery_s, revived = await _outage(
        make_cluster, chaos_nats, tiny_model_dir, outage_s, ("--nats-outage-fail-s", str(fail_s)))
    try:
        tally = judge(outcomes, expected(tiny_model_dir, orders, prompts(STREAMS), TOKENS))
        print(f"\nNATS down {outage_s:g} s: in flight {tally.line()}; success again {recovery_s:.2f} s after "
              f"NATS returned")
        # The gateway ended its streams once it had been away from NATS for fail_s: an error
        # each client saw, long before the outage ended, never a hang.
        assert tally.hung == 0 and tally.wrong == 0 and tally.failed == STREAMS, tally
        assert all(o.ended - o.started < fail_s + 5 for o in outcomes)
        assert recovery_s < 5.0
        assert await _all_reconnected(cluster) == []  # scheduler included: bypass would hide it
        assert not (left := await wait_blocks_back(cluster.nats_url, ["sim-0", "sim-1", "sim-2"])), left
        assert dead_processes(cluster) == []
    finally:
        cluster.stop()
        revived.stop()


async def test_nats_down_20_s_nothing_gives_up(make_cluster, chaos_nats, tiny_model_dir):
    """The default run's shorter equivalent of the 150 s outage: llumlets decoding when NATS went
    away used to exit 9-35 s in (their reconnect buffer full)."""
    await _long_outage(make_cluster, chaos_nats, tiny_model_dir, 20.0, 5.0)


@pytest.mark.chaos
@pytest.mark.timeout(400)
async def test_nats_down_150_s_nothing_gives_up(make_cluster, chaos_nats, tiny_model_dir):
    await _long_outage(make_cluster, chaos_nats, tiny_model_dir, 150.0, 30.0)
