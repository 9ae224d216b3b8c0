"""Gateway loss: with two gateways, killing one aborts its requests on the engines within 2 s
(the llumlets watch every gateway's heartbeat), and the other's streams see no error. A stream
whose request is aborted by someone other than its gateway ends with an error at once instead
of waiting out the inactivity timeout."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import nats

from shared import subjects
from shared.messages import AbortRequest, encode
from tests.chaos.harness import (
    GenerateLog, dead_processes, judge, log_lines, model_name, stream_completion, wait_blocks_back,
)
from tests.chaos.test_instance_death import expected, prompts
from tests.support.cluster import ServiceProcess, free_port
from tests.support.observer import NatsObserver

INSTANCES = ["sim-0", "sim-1", "sim-2"]


def start_second_gateway(cluster) -> tuple[ServiceProcess, str]:
    port = free_port()
    proc = cluster.spawn("gateway-2", "gateway", "--model", str(cluster.model_dir), "--port", str(port),
                         "--gateway-id", "gw-two")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).json().get("instances", 0) >= len(INSTANCES):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(proc.log()[-2000:])


async def test_a_killed_gateways_requests_are_aborted_on_the_engines_and_the_others_streams_are_untouched(
        make_cluster, tiny_model_dir):
    cluster = make_cluster(3)
    victim, victim_url = start_second_gateway(cluster)
    name, tokens, orphan_tokens = model_name(cluster), 300, 1500
    survivors_prompts = prompts(16)
    async with NatsObserver(cluster.nats_url) as observer, GenerateLog(cluster.nats_url) as generated, \
            httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http, \
            httpx.AsyncClient(base_url=victim_url, timeout=60) as victim_http:
        survivors = [asyncio.create_task(stream_completion(http, name, p, tokens)) for p in survivors_prompts]
        orphans = [asyncio.create_task(stream_completion(victim_http, name, p[::-1], orphan_tokens))
                   for p in prompts(16)]
        assert await observer.wait_for(lambda latest: sum(r.num_running for r in latest.values()) >= 24, 20)
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        victim.kill()
        # The orphans are gone from the engines once what runs is no more than the survivors left.
        cleared_at = None
        while cleared_at is None and time.monotonic() < killed_at + 10:
            left = sum(not task.done() for task in survivors)
            if sum(r.num_running + r.num_waiting for r in observer.latest.values()) <= left:
                cleared_at = time.monotonic()
            await asyncio.sleep(0.02)
        outcomes = await asyncio.gather(*survivors)
        await asyncio.gather(*orphans)  # their client saw its connection drop
        tally = judge(outcomes, expected(tiny_model_dir, generated, survivors_prompts, tokens))
    aborted = [line for name_ in INSTANCES for line in log_lines(cluster, name_, "gw-two went silent")]
    print(f"\ngateway kill: survivors {tally.line()}; orphans off the engines "
          f"{'never' if cleared_at is None else f'{cleared_at - killed_at:.2f} s'} after the kill")
    assert tally.completed == len(survivors_prompts) and tally.wrong == 0, tally
    assert aborted, "no llumlet noticed the gateway's death"
    assert cleared_at is not None and cleared_at - killed_at <= 2.0, cleared_at and cleared_at - killed_at
    assert not (left := await wait_blocks_back(cluster.nats_url, INSTANCES)), left
    assert dead_processes(cluster, "gateway-2") == []


async def test_an_abort_from_elsewhere_ends_the_stream_with_an_error_at_once(make_cluster):
    cluster = make_cluster(3)
    name = model_name(cluster)
    async with GenerateLog(cluster.nats_url) as generated, \
            httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        prompt = prompts(1)[0]
        task = asyncio.create_task(stream_completion(http, name, prompt, 1500))
        deadline = time.monotonic() + 20
        while not generated.orders and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # mid-decode
        operator = await nats.connect(cluster.nats_url)
        aborted_at = time.monotonic()
        await operator.publish(subjects.ABORT_ALL, encode(AbortRequest(generated.request_id(prompt), "operator")))
        await operator.close()
        outcome = await task
    print(f"\nforeign abort: stream ended {outcome.ended - aborted_at:.2f} s later: {outcome.error}")
    assert outcome.error and "aborted" in outcome.error and not outcome.hung, outcome
    assert outcome.ended - aborted_at < 2.0
    assert not (left := await wait_blocks_back(cluster.nats_url, INSTANCES)), left


async def test_a_gateway_frozen_past_the_silence_limit_resumes_what_the_llumlets_dropped(make_cluster, tiny_model_dir):
    """A gateway alive but silent (SIGSTOP here; starved on a loaded machine, as seen at load 11 on
    2 cores) has its requests aborted by the llumlets as orphans. Their error chunks are resumable:
    once it runs again it resumes each from the tokens it delivered, and its clients see no error."""
    cluster = make_cluster(3)
    name, tokens = model_name(cluster), 300
    sent = prompts(12)
    gateway = cluster.procs["gateway"].process
    async with NatsObserver(cluster.nats_url) as observer, GenerateLog(cluster.nats_url) as generated, \
            httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        streams = [asyncio.create_task(stream_completion(http, name, p, tokens)) for p in sent]
        assert await observer.wait_for(lambda latest: sum(r.num_running for r in latest.values()) >= 12, 20)
        await asyncio.sleep(0.3)
        gateway.send_signal(signal.SIGSTOP)
        await asyncio.sleep(2.5)  # past the llumlets' 1.5 s limit
        gateway.send_signal(signal.SIGCONT)
        outcomes = await asyncio.gather(*streams)
        tally = judge(outcomes, expected(tiny_model_dir, generated, sent, tokens))
    aborted = [line for name_ in INSTANCES for line in log_lines(cluster, name_, "went silent: aborting")]
    print(f"\ngateway frozen 2.5 s: {tally.line()}; {len(generated.resumes)} resumes")
    assert aborted, "no llumlet took the frozen gateway for gone: the test proves nothing"
    assert tally.completed == len(sent) and tally.wrong == 0, tally
    assert generated.resumes
    assert not (left := await wait_blocks_back(cluster.nats_url, INSTANCES)), left
    assert dead_processes(cluster) == []
