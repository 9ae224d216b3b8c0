"""`corral drain` (what a llumlet pod's preStop runs): the instance is emptied by live migration
while its request keeps streaming elsewhere, long before the request would have finished."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from shared.embedded_nats import start_nats
from tests.support.cluster import REPO, Cluster, free_port

SIM = ("--sim-time-scale", "1.0", "--sim-num-blocks", "400", "--max-model-len", "2048")


def drain(nats_url: str, instance_id: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "drain", "--nats-url", nats_url,
                           "--instance-id", instance_id, "--timeout-s", str(timeout_s)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 30)


@pytest.mark.slow
async def test_drain_migrates_a_running_request_away_and_returns_once_empty(tiny_model_dir, tmp_path):
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path)
    try:
        cluster.start_scheduler()
        probe_port = free_port()
        cluster.start_llumlet("leaving", *SIM, "--metrics-port", str(probe_port))
        cluster.start_gateway()
        await asyncio.to_thread(cluster.wait_ready, 1)
        model = httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]
        tokens = 0
        drained: list[tuple[subprocess.CompletedProcess, float]] = []

        async def stream() -> None:
            nonlocal tokens
            body = {"model": model, "prompt": "x " * 50, "max_tokens": 1500, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300) as http:
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    assert reply.status_code == 200
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[len("data: "):])
                            assert "error" not in event, event
                            if event.get("usage"):
                                tokens = event["usage"]["completion_tokens"]

        streaming = asyncio.create_task(stream())
        await asyncio.sleep(1.0)  # running on "leaving", the only instance
        cluster.start_llumlet("staying", *SIM)
        await asyncio.to_thread(cluster.wait_ready, 2)
        ready = f"http://127.0.0.1:{probe_port}/ready"
        assert httpx.get(ready).status_code == 200
        started = time.monotonic()
        drained.append((await asyncio.to_thread(drain, server.url, "leaving", 60.0), time.monotonic() - started))
        result, took = drained[0]
        assert result.returncode == 0, result.stderr[-2000:]
        assert "leaving is empty" in result.stderr
        assert not streaming.done(), "the request ended before the drain: nothing was shown to migrate"
        not_ready = httpx.get(ready)  # a ReplicaSet scaling in deletes not-ready pods first
        assert not_ready.status_code == 503 and not_ready.text.strip() == "draining"
        await asyncio.wait_for(streaming, 240)
        assert tokens == 1500
        assert "migrat" in cluster.procs["leaving"].log().lower()
        # Draining again an instance that is already empty returns at once.
        again = await asyncio.to_thread(drain, server.url, "leaving", 10.0)
        assert again.returncode == 0 and "is empty" in again.stderr
        # An instance that is not there: nothing to drain.
        absent = await asyncio.to_thread(drain, server.url, "nobody", 10.0)
        assert absent.returncode == 0 and "does not answer" in absent.stderr
        assert took < 60
    finally:
        cluster.stop()
        server.stop()


def test_drain_refuses_a_bad_instance_id():
    result = subprocess.run([sys.executable, "-m", "services.cli", "drain", "--instance-id", "a.b"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "not a valid subject token" in result.stderr


async def test_drain_gives_up_at_its_deadline_when_nothing_can_take_the_requests(tiny_model_dir, tmp_path):
    """No migration pairing (a scheduler with it off): what the instance holds stays, and the drain
    says so with exit status 1 at its deadline instead of waiting for the kubelet's SIGKILL."""
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path)
    try:
        cluster.start_scheduler("--no-enable-migration")
        cluster.start_llumlet("stuck", *SIM)
        cluster.start_gateway()
        await asyncio.to_thread(cluster.wait_ready, 1)
        model = httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300) as http:
            body = {"model": model, "prompt": "x " * 50, "max_tokens": 1500, "ignore_eos": True}
            request = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(1.0)
            started = time.monotonic()
            result = await asyncio.to_thread(drain, server.url, "stuck", 2.0)
            took = time.monotonic() - started
            assert result.returncode == 1, result.stderr[-2000:]
            assert "stuck still holds 1 requests after 2 s" in result.stderr
            assert took < 15
            assert not request.done()
            request.cancel()
    finally:
        cluster.stop()
        server.stop()
