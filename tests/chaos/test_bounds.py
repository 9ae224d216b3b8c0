"""No unbounded queues in the gateway: requests past --max-requests-in-flight get a 503 with
Retry-After, and a client that stops reading gets its stream ended (and the engine's copy
aborted) once --max-buffered-chunks engine steps wait for it, instead of an ever longer queue."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.chaos.harness import log_lines, model_name, stream_completion, wait_blocks_back
from tests.chaos.test_instance_death import prompts
from tests.support.observer import NatsObserver

INSTANCES = ["sim-0", "sim-1", "sim-2"]


async def test_requests_past_the_in_flight_bound_get_503_with_retry_after(make_cluster):
    cluster = make_cluster(3, gateway_args=("--max-requests-in-flight", "4"))
    name = model_name(cluster)
    async with NatsObserver(cluster.nats_url) as observer, \
            httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        admitted = [asyncio.create_task(stream_completion(http, name, p, 300)) for p in prompts(4)]
        assert await observer.wait_for(lambda latest: sum(r.num_running for r in latest.values()) >= 4, 20)
        body = {"model": name, "prompt": prompts(5)[4], "max_tokens": 5, "stream": True}
        refused = await http.post("/v1/completions", json=body)
        outcomes = await asyncio.gather(*admitted)
        after = await http.post("/v1/completions", json={**body, "stream": False})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert "max-requests-in-flight" in refused.json()["error"]["message"]
    assert all(o.completed for o in outcomes), outcomes
    assert after.status_code == 200  # the bound frees as requests end


def send_and_never_read(port: int, body: dict) -> socket.socket:
    """A streamed request from a client that never reads its answer (a small receive buffer, so
    the gateway's writes back up soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


# Under the chaos marker: it needs the client's unread bytes to fill the kernel's buffers first,
# and on a quiet machine loopback TCP autotunes the gateway's send buffer (tcp_wmem, up to 4 MiB
# here) past this request's whole output (~650 KB in 25 s), so the gateway's writes never block.
# It passed on a loaded machine (7.4 s) and failed on a quiet one; the bound itself is unit-tested
# in tests/unit/test_gateway_stream_bounds.py.
@pytest.mark.chaos
async def test_a_client_that_stops_reading_is_ended_and_its_engine_copy_aborted(make_cluster):
    # Kernel buffers take the first ~200 KB a client does not read (~2,000 tokens' events), then
    # the gateway's writes block and its per-stream queue fills. 8,000 tokens at 4 ms a step:
    # 32 s of decoding were the client reading.
    cluster = make_cluster(3, gateway_args=("--max-buffered-chunks", "32"),
                           llumlet_args=("--sim-time-scale", "0.2", "--max-model-len", "8192", "--sim-num-blocks", "1000"))
    name = model_name(cluster)
    sock = send_and_never_read(cluster.gateway_port, {"model": name, "prompt": prompts(1)[0], "max_tokens": 8000,
                                                       "stream": True, "ignore_eos": True})
    try:
        started = time.monotonic()
        async with NatsObserver(cluster.nats_url) as observer:
            assert await observer.wait_for(lambda latest: sum(r.num_running for r in latest.values()) == 1, 20)
        left = await wait_blocks_back(cluster.nats_url, INSTANCES, timeout_s=25)
        ended_after = time.monotonic() - started
        sock.setblocking(False)
        received = b""
        deadline = time.monotonic() + 10
        while b"too slowly" not in received and time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                await asyncio.sleep(0.05)
                continue
            if not data:
                break
            received += data
    finally:
        sock.close()
    print(f"\nslow client: engine copy aborted {ended_after:.1f} s after it started; "
          f"{len(received)} bytes reached the client")
    assert not left, left
    assert ended_after < 25
    assert log_lines(cluster, "gateway", "wait for a slow client")
    assert b"too slowly" in received  # the client, once it reads, sees why its stream ended
