"""Scheduler high availability: two replicas share dispatch, one leads migration pairing; killing
the leader under load loses no request and the other takes pairing over. A frozen scheduler
(SIGSTOP: connected, answering nothing) costs one dispatch timeout, not one per request: the
gateway's circuit breaker bypasses it and probes back."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import nats
import pytest

from shared import subjects
from shared.messages import MigrateOrder, decode
from tests.chaos.harness import (
    SIM_ARGS, GenerateLog, dead_processes, judge, log_lines, model_name, stream_completion, wait_blocks_back,
)
from tests.chaos.test_instance_death import expected, prompts
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver

INSTANCES = ["sim-0", "sim-1", "sim-2"]
LEADS = "this scheduler leads migration pairing"


@pytest.fixture
def two_scheduler_cluster(chaos_nats, tiny_model_dir, tmp_path):
    (tmp_path / "logs").mkdir()
    cluster = Cluster(chaos_nats.url, tiny_model_dir, tmp_path / "logs")
    for sid in ("a", "b"):
        cluster.spawn(f"scheduler-{sid}", "scheduler", "--scheduler-id", sid)
    for instance in INSTANCES:
        cluster.start_llumlet(instance, *SIM_ARGS)
    cluster.start_gateway()
    cluster.wait_ready(instances=len(INSTANCES))
    yield cluster
    cluster.stop()


def dispatches_past_timeout(metrics: str) -> int:
    """The gateway's dispatches that took longer than its 0.5 s scheduler timeout (a bucket bound)."""
    count = bucket = None
    for line in metrics.splitlines():
        if line.startswith("corral:gateway_dispatch_duration_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith('corral:gateway_dispatch_duration_seconds_bucket{le="0.5"}'):
            bucket = float(line.split()[-1])
    assert count is not None and bucket is not None, "no dispatch histogram on the gateway"
    return int(count - bucket)


async def wait_log(cluster: Cluster, name: str, needle: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not log_lines(cluster, name, needle):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def test_killing_the_leading_scheduler_loses_no_request_and_the_other_takes_pairing_over(
        two_scheduler_cluster, tiny_model_dir):
    cluster = two_scheduler_cluster
    assert await wait_log(cluster, "scheduler-a", LEADS, 10), "the lowest id never led"
    orders: list[tuple[float, str, bool]] = []  # (when, pairer prefix, cancel)

    async def on_order(msg) -> None:
        order = decode(msg.data, MigrateOrder)
        orders.append((time.monotonic(), order.pair_id.split("-")[0], order.cancel))

    watcher = await nats.connect(cluster.nats_url)
    await watcher.subscribe(f"{subjects.PREFIX}.llumlet.*.migrate", cb=on_order)
    name, tokens = model_name(cluster), 200
    sent_prompts = prompts(32) + [p[::-1] for p in prompts(16)]
    async with NatsObserver(cluster.nats_url) as observer, GenerateLog(cluster.nats_url) as generated, \
            httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        first = [asyncio.create_task(stream_completion(http, name, p, tokens)) for p in prompts(32)]
        assert await observer.wait_for(lambda latest: sum(r.num_running for r in latest.values()) >= 16, 20)
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        cluster.procs["scheduler-a"].kill()
        # Dispatches during the failover: the surviving replica (or a bypass) places every one.
        second = []
        for p in sent_prompts[32:]:
            second.append(asyncio.create_task(stream_completion(http, name, p, tokens)))
            await asyncio.sleep(0.05)
        outcomes = await asyncio.gather(*first, *second)
        await watcher.close()
        tally = judge(outcomes, expected(tiny_model_dir, generated, sent_prompts, tokens))
    print(f"\nscheduler SIGKILL (2 replicas): {tally.line()}; orders seen {len(orders)}")
    assert tally.completed == tally.sent and tally.wrong == 0, tally
    assert await wait_log(cluster, "scheduler-b", LEADS, 5), "the surviving replica never took pairing over"
    took_over = [line for line in log_lines(cluster, "scheduler-b", LEADS)]
    assert len(took_over) == 1
    # One pairer at a time: while both lived, every order came from one replica.
    before = {prefix for at, prefix, cancel in orders if at < killed_at and not cancel}
    assert len(before) <= 1, before
    assert not (left := await wait_blocks_back(cluster.nats_url, INSTANCES)), left
    assert dead_processes(cluster, "scheduler-a") == []


async def test_a_frozen_scheduler_costs_one_timeout_then_requests_bypass_and_it_is_probed_back(make_cluster):
    cluster = make_cluster(3)
    name = model_name(cluster)
    pid = cluster.procs["scheduler"].process.pid
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        waited_before = dispatches_past_timeout((await http.get("/metrics")).text)
        os.kill(pid, signal.SIGSTOP)
        try:
            frozen = []
            for p in prompts(24):  # one request every 100 ms for 2.4 s
                frozen.append(asyncio.create_task(stream_completion(http, name, p, 20)))
                await asyncio.sleep(0.1)
            frozen = await asyncio.gather(*frozen)
            waited = dispatches_past_timeout((await http.get("/metrics")).text) - waited_before
        finally:
            os.kill(pid, signal.SIGCONT)
        # Thawed: within the breaker's open time (2 s after the failed probe) a request probes it.
        after = []
        deadline = time.monotonic() + 10
        while not log_lines(cluster, "gateway", "answers again") and time.monotonic() < deadline:
            after.append(await stream_completion(http, name, prompts(1)[0], 20))
            await asyncio.sleep(0.2)
        assert log_lines(cluster, "gateway", "answers again"), "the breaker never probed the scheduler back"
    ttfts = sorted(o.first_at - o.started for o in frozen)
    print(f"\nscheduler SIGSTOP: TTFT median {ttfts[len(ttfts) // 2] * 1000:.0f} ms, "
          f"{waited} of {len(ttfts)} waited the 0.5 s dispatch timeout")
    assert judge(frozen).completed == len(frozen) and judge(after).completed == len(after)
    # The first timeout opens the breaker; one probe 1 s later times out too; the next is 2 s on.
    # (Counted by the gateway's own dispatch times: one released by the breaker opening waited
    # up to 0.4 s, which by its TTFT a loaded machine can make look like a timeout.)
    assert 1 <= waited <= 2, (waited, ttfts)
    assert ttfts[len(ttfts) // 2] < 0.25, ttfts
    assert not (left := await wait_blocks_back(cluster.nats_url, INSTANCES)), left
