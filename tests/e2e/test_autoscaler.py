"""Auto-scaling with real processes: a load step adds instances; when load falls they drain and
stop, and every request still completes."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats

from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import ScalingEvent, decode
from tests.support.cluster import Cluster


async def test_load_step_scales_out_then_in_without_losing_requests(tiny_model_dir, tmp_path):
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path)
    events: list[ScalingEvent] = []
    nc = await nats.connect(server.url)

    async def on_event(msg) -> None:
        events.append(decode(msg.data, ScalingEvent))

    await nc.subscribe(subjects.SCALING_EVENTS, cb=on_event)
    try:
        cluster.start_scheduler()
        cluster.start_autoscaler(
            "--initial-instances", "1", "--min-instances", "1", "--max-instances", "3",
            "--scale-out-below", "3", "--scale-in-above", "60", "--sustain-s", "0.5", "--cooldown-s", "1.5",
            "--tick-s", "0.2",
            llumlet_args=("--sim-num-blocks", "120", "--sim-time-scale", "0.2", "--max-model-len", "1024"),
        )
        cluster.start_gateway()
        await asyncio.to_thread(cluster.wait_ready, 1)
        model = httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:

            async def one(i: int) -> httpx.Response:
                await asyncio.sleep(i * 0.05)
                return await http.post("/v1/completions", json={"model": model, "prompt": "load " * 100, "max_tokens": 200})

            replies = await asyncio.gather(*(one(i) for i in range(60)))
        assert [r.status_code for r in replies] == [200] * 60, [r.text for r in replies if r.status_code != 200][:3]
        assert all(r.json()["usage"]["completion_tokens"] == 200 for r in replies)
        assert any(e.action == "scale_out" for e in events), events
        # Idle now: the extra instances drain and stop, back to the minimum.
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and sum(e.action == "stopped" for e in events) < sum(e.action == "scale_out" for e in events):
            await asyncio.sleep(0.2)
        scaled_out = sum(e.action == "scale_out" for e in events)
        stopped = sum(e.action == "stopped" for e in events)
        assert stopped == scaled_out, events
        assert events[-1].instances == 1
    finally:
        await nc.close()
        cluster.stop()
        server.stop()
