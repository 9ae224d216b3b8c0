"""An instance that dies (SIGKILL) or freezes (SIGSTOP) under load: its requests resume on the
others, each client's stream continuing unbroken, with exactly the output a fault-free run gives."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from datetime import datetime

import httpx

from tests.chaos.harness import (
    GenerateLog, SimOutput, dead_processes, judge, log_lines, model_name, stream_completion, wait_blocks_back,
)
from tests.support.observer import NatsObserver

STREAMS = 24
TOKENS = 300


def prompts(n: int) -> list[list[int]]:
    return [[1 + (i * 7 + j) % 200 for j in range(16 + i % 5)] for i in range(n)]


async def load_with_fault(cluster, fault, victim: str, orders: GenerateLog, streams: int = STREAMS,
                          tokens: int = TOKENS, **sampling) -> tuple[list, float]:
    """`streams` concurrent streams; `fault()` once the victim holds several of them mid-decode.
    The outcomes (in the order of `prompts`), and when the fault struck (wall clock)."""
    name = model_name(cluster)
    async with NatsObserver(cluster.nats_url) as observer, \
            httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        tasks = [asyncio.create_task(stream_completion(http, name, p, tokens, **sampling)) for p in prompts(streams)]
        assert await observer.wait_for(lambda latest: victim in latest and latest[victim].num_running >= 4, 20), \
            "the victim never ran several requests"
        await asyncio.sleep(0.5)  # mid-decode: tokens have streamed
        struck = time.time()
        fault()
        outcomes = await asyncio.gather(*tasks)
    return outcomes, struck


def expected(model_dir, orders: GenerateLog, sent: list[list[int]], tokens: int) -> list[str]:
    """The text each outcome (in the order of `sent`) must have: the simulator's stream for it."""
    sim = SimOutput(model_dir)
    texts = [sim.text(orders.request_id(prompt), prompt, tokens) for prompt in sent]
    sim.tokenizer.close()
    return texts


def resumes_logged(cluster) -> list[float]:
    """Each resume's time (ms) from losing the holder to the new instance acknowledging."""
    return [float(m.group(1)) for line in set(log_lines(cluster, "gateway", "resumed on"))
            if (m := re.search(r"\((\d+) ms\)", line))]


def resumed_after(cluster, struck: float) -> list[float]:
    """Seconds from the fault to each resume's log line (detection and placement)."""
    stamps = {line[:23] for line in log_lines(cluster, "gateway", "resumed on")}
    return sorted(datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp() - struck for s in stamps)


async def test_sigkilled_instance_requests_resume_unbroken(make_cluster, tiny_model_dir):
    cluster = make_cluster(3)
    victim = "sim-1"
    async with GenerateLog(cluster.nats_url) as orders:
        outcomes, struck = await load_with_fault(cluster, cluster.procs[victim].kill, victim, orders)
    tally = judge(outcomes, expected(tiny_model_dir, orders, prompts(STREAMS), TOKENS))
    resumed = resumes_logged(cluster)
    print(f"\nSIGKILL: {tally.line()} resumed {len(resumed)} (orders {len(orders.resumes)}) "
          f"resume ms {sorted(resumed)}")
    after = resumed_after(cluster, struck)
    print(f"fault → resumed: {after[0]:.2f}–{after[-1]:.2f} s")
    for outcome in outcomes:
        if outcome.error:
            print("error:", outcome.error)
    assert after[-1] < 1.5, "a death must be noticed within ~1 s (the heartbeat), not the instance timeout"
    assert tally.completed == STREAMS and tally.wrong == 0, (tally, [o for o in outcomes if not o.completed][:3])
    assert resumed, "the victim held requests, none resumed"
    detected = [line for line in log_lines(cluster, "gateway", "stopped reporting")]
    assert detected, "the gateway never noticed the death"
    assert not (left := await wait_blocks_back(cluster.nats_url, ["sim-0", "sim-2"])), left
    assert dead_processes(cluster, victim) == []
    # The scheduler logs the death (after its instance timeout).
    deadline = time.monotonic() + 6
    while not log_lines(cluster, "scheduler", f"instance {victim} died or left") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert log_lines(cluster, "scheduler", f"instance {victim} died or left")


async def test_frozen_instance_requests_and_new_dispatches_go_elsewhere(make_cluster, tiny_model_dir):
    """SIGSTOP: the process holds its NATS connection (no 'no responders'), answers nothing and
    stops reporting. What it held resumes elsewhere; a request dispatched to it meanwhile does
    not wait for the generate timeout but goes elsewhere as soon as the heartbeat says it is gone.
    Once it thaws, its stale copies are aborted and its blocks come back too."""
    cluster = make_cluster(3)
    victim = "sim-2"
    pid = cluster.procs[victim].process.pid
    late_prompts = [[p + 1 for p in prompt] for prompt in prompts(12)]  # none equal to the first ones
    async with GenerateLog(cluster.nats_url) as orders:
        outcomes, struck = await load_with_fault(cluster, lambda: os.kill(pid, signal.SIGSTOP), victim, orders)
        try:
            # New requests right after the freeze: the scheduler still lists the victim for ~3 s.
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
                late = await asyncio.gather(*(stream_completion(http, model_name(cluster), p, 20)
                                              for p in late_prompts))
        finally:
            os.kill(pid, signal.SIGCONT)
    tally = judge(outcomes, expected(tiny_model_dir, orders, prompts(STREAMS), TOKENS))
    late_tally = judge(late, expected(tiny_model_dir, orders, late_prompts, 20))
    slowest_late = max(o.ended - o.started for o in late)
    print(f"\nSIGSTOP: {tally.line()} resumed {len(resumes_logged(cluster))}; "
          f"dispatched after: {late_tally.line()}, slowest {slowest_late:.2f} s")
    assert tally.completed == STREAMS and tally.wrong == 0, tally
    assert late_tally.completed == 12 and late_tally.wrong == 0, late_tally
    assert slowest_late < 4.0, "a request sent to the frozen instance waited for the generate timeout"
    assert not (left := await wait_blocks_back(cluster.nats_url, ["sim-0", "sim-1", "sim-2"], 15)), left
    assert dead_processes(cluster) == []


async def test_seeded_sampling_is_not_resumed_but_ends_with_an_error(make_cluster):
    """State an engine cannot rebuild from tokens (a seeded sampler's) is refused honestly."""
    cluster = make_cluster(2)
    victim = "sim-0"
    async with GenerateLog(cluster.nats_url) as orders:
        outcomes, _ = await load_with_fault(cluster, cluster.procs[victim].kill, victim, orders, streams=12,
                                            temperature=0.8, seed=7)
    tally = judge(outcomes)
    print(f"\nSIGKILL, seeded sampling: {tally.line()}")
    assert tally.hung == 0 and tally.failed >= 1, tally
    failed = [o for o in outcomes if o.error]
    assert all("cannot be resumed" in o.error and "seeded sampling" in o.error for o in failed), failed[0].error
    assert tally.completed + tally.failed == 12
    assert not (left := await wait_blocks_back(cluster.nats_url, ["sim-1"])), left
