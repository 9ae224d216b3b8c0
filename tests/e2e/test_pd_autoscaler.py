"""Prefill/decode pools under the autoscaler, with real processes (issue 19 §2): it starts one
llumlet per pool with its role, a burst of long prompts queues on the prefill instance and adds a
prefill instance (not a decode one), every request completes, and once idle the pool shrinks
back to one."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats

from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import InstanceRole, ScalingAction, ScalingEvent, decode
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver


async def test_a_prefill_queue_scales_the_prefill_pool_out_then_in(tiny_model_dir, tmp_path):
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path)
    events: list[ScalingEvent] = []
    nc = await nats.connect(server.url)

    async def on_event(msg) -> None:
        events.append(decode(msg.data, ScalingEvent))

    await nc.subscribe(subjects.SCALING_EVENTS, cb=on_event)
    try:
        async with NatsObserver(server.url) as observer:
            cluster.start_scheduler()
            cluster.start_autoscaler(
                "--initial-prefill", "1", "--initial-decode", "1", "--min-instances", "1", "--max-instances", "2",
                "--prefill-scale-out-tokens", "2000", "--scale-in-above", "20", "--sustain-s", "0.5",
                "--cooldown-s", "1.5", "--tick-s", "0.2",
                llumlet_args=("--sim-num-blocks", "200", "--sim-time-scale", "0.3", "--max-model-len", "1024"),
            )
            cluster.start_gateway()
            await asyncio.to_thread(cluster.wait_ready, 2)
            roles = lambda latest: sorted(r.role.value for r in latest.values() if not r.draining)  # noqa: E731
            assert await observer.wait_for(lambda latest: roles(latest) == ["decode", "prefill"], 10)
            model = httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as http:
                replies = await asyncio.gather(*(
                    http.post("/v1/completions", json={"model": model, "prompt": f"{i} long prompt " * 60,
                                                       "max_tokens": 20})
                    for i in range(40)))
            assert [r.status_code for r in replies] == [200] * 40, [r.text for r in replies if r.status_code != 200][:3]
            assert all(r.json()["usage"]["completion_tokens"] == 20 for r in replies)
            added = [e.instance_id for e in events if e.action is ScalingAction.SCALE_OUT]
            assert added, events
            # Every instance added was a prefill one: the queue was the prefill pool's signal.
            assert all(observer.latest[i].role is InstanceRole.PREFILL for i in added if i in observer.latest)
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and roles(observer.latest) != ["decode", "prefill"]:
                await asyncio.sleep(0.2)
            assert roles(observer.latest) == ["decode", "prefill"], (events, observer.latest)
    finally:
        await nc.close()
        cluster.stop()
        server.stop()
