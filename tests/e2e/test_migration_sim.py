"""Live migration end to end: real scheduler, llumlet and gateway processes over real NATS.

Instances start drained (no dispatch to them) when a test needs an idle destination: undraining
one makes it the freest instance, and the scheduler pairs the loaded one with it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from transformers import AutoTokenizer

from services.llumlet.engines import model_vocabulary
from services.llumlet.engines.sim.engine import SyntheticTokens
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import DrainOrder, MigrateOrder, encode
from tests.support.cluster import Cluster
from tests.support.stream_watch import StreamWatch

# The tests migrate requests a moment after they start: no residence guard.
SIM = ("--sim-time-scale", "0.05", "--max-model-len", "4096", "--report-interval-s", "0.05",
       "--migration-min-residence-s", "0")
# The scheduler pairs an instance below freeness 20 (blocks per running request) with one above 60.
INSTANCE_TIMEOUT_S = 2.0  # scheduler and gateway forget a silent instance after this
SCHEDULER = ("--migrate-out-freeness", "20", "--migrate-in-freeness", "60", "--migration-interval-s", "0.1",
             "--instance-timeout-s", str(INSTANCE_TIMEOUT_S))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """NATS, the scheduler and a gateway; each test starts (and stops) its own llumlets."""
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path_factory.mktemp("migration-logs"))
    cluster.start_scheduler(*SCHEDULER)
    cluster.start_gateway("--instance-timeout-s", str(INSTANCE_TIMEOUT_S))
    try:
        yield cluster
    finally:
        cluster.stop()
        server.stop()


@pytest.fixture
def llumlets(cluster):
    started: list[str] = []

    def start(*extra: str) -> str:
        instance_id = f"m-{uuid.uuid4().hex[:6]}"
        cluster.start_llumlet(instance_id, *SIM, *extra)
        started.append(instance_id)
        return instance_id

    yield start
    for instance_id in started:
        cluster.procs[instance_id].terminate()
    deadline = time.monotonic() + 5 * INSTANCE_TIMEOUT_S
    while time.monotonic() < deadline:  # the next test's requests must not go to these
        try:
            if httpx.get(f"{cluster.base_url}/healthz", timeout=1).json().get("instances", 0) == 0:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)


class Watch(StreamWatch):
    """Stream watch plus the orders this module's tests give."""

    async def order(self, instance_id: str, message) -> None:
        await self.nc.publish(subjects.llumlet(instance_id, "drain" if isinstance(message, DrainOrder) else "migrate"),
                              encode(message))


async def wait_ready(cluster: Cluster, watch: Watch, *instance_ids: str, timeout_s: float = 60.0) -> None:
    """The gateway answers and the llumlets report (with their KV receivers up)."""
    async with asyncio.timeout(timeout_s), httpx.AsyncClient(base_url=cluster.base_url, timeout=1) as http:
        while True:
            try:
                if (await http.get("/healthz")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    assert await watch.wait_for(lambda latest: all(i in latest and latest[i].kv_address for i in instance_ids),
                                timeout_s), "llumlets did not report"


def model_name(cluster: Cluster) -> str:
    return httpx.get(f"{cluster.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


async def sse_lines(reply: httpx.Response):
    """Lines split on "\n" only: httpx's aiter_lines also splits on U+2028 and friends, which
    random synthetic tokens do decode to."""
    pending = b""
    async for data in reply.aiter_bytes():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()


async def stream_chat(http: httpx.AsyncClient, model: str, content: str, max_tokens: int) -> dict:
    """One streamed chat completion: its id, text, finish reason, usage, or the error event."""
    result = {"id": None, "text": "", "finish": None, "usage": None, "error": None}
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in sse_lines(reply):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result["error"] = event["error"]
                continue
            result["id"] = event["id"]
            for choice in event.get("choices", []):
                result["text"] += choice["delta"].get("content") or ""
                result["finish"] = choice.get("finish_reason") or result["finish"]
            result["usage"] = event.get("usage") or result["usage"]
    return result


def all_free(latest, *instance_ids: str) -> bool:
    return all(
        i in latest and latest[i].num_blocks_free == latest[i].num_blocks_total and latest[i].reserved_blocks == 0
        and latest[i].num_running == 0 and latest[i].num_waiting == 0
        for i in instance_ids
    )


async def test_scheduler_pairs_the_loaded_instance_and_streams_stay_exact(cluster, llumlets, tiny_model_dir):
    """The SSE streams of migrated requests have no gap and no duplicate: their text is exactly
    the decoding of the request's synthetic token stream."""
    loaded = llumlets("--sim-num-blocks", "300", "--sim-kv-bytes-per-token", "256")
    idle = llumlets("--sim-num-blocks", "300", "--sim-kv-bytes-per-token", "256")
    vocab, eos, _ = model_vocabulary(str(tiny_model_dir))
    tokens = SyntheticTokens(vocab, eos, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    async with Watch(cluster.nats_url) as watch:
        await wait_ready(cluster, watch, loaded, idle)
        await watch.order(idle, DrainOrder(drain=True))
        assert await watch.wait_for(lambda latest: latest[idle].draining, 5)
        model = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            requests = [asyncio.create_task(stream_chat(http, model, f"story {i} " * 30, 900)) for i in range(8)]
            assert await watch.wait_for(lambda latest: latest[loaded].num_running == 8, 10)
            await watch.order(idle, DrainOrder(drain=False))
            results = await asyncio.gather(*requests)
        assert await watch.wait_finished(*(r["id"] for r in results))
        for result in results:
            assert result["error"] is None and result["finish"] == "length"
            assert result["usage"]["completion_tokens"] == 900
            key = tokens.key(result["id"])
            expected = [tokens.token(key, i) for i in range(900)]
            assert watch.tokens(result["id"]) == expected
            assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        migrated = [r["id"] for r in results if len(watch.publishers(r["id"])) > 1]
        assert migrated, "no request migrated"
        assert all(watch.publishers(r)[:2] == [loaded, idle] for r in migrated)
        assert await watch.wait_for(lambda latest: all_free(latest, loaded, idle), 10), watch.latest


async def test_load_evens_out_under_steady_load(cluster, llumlets):
    a = llumlets("--sim-num-blocks", "300")
    b = llumlets("--sim-num-blocks", "300")
    async with Watch(cluster.nats_url) as watch:
        await wait_ready(cluster, watch, a, b)
        await watch.order(b, DrainOrder(drain=True))
        assert await watch.wait_for(lambda latest: latest[b].draining, 5)
        model = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            burst = [asyncio.create_task(stream_chat(http, model, f"burst {i} " * 40, 1500)) for i in range(10)]
            assert await watch.wait_for(lambda latest: latest[a].num_running == 10, 10)
            await watch.order(b, DrainOrder(drain=False))
            steady = []
            for i in range(10):  # a steady trickle on top of the imbalance
                steady.append(asyncio.create_task(stream_chat(http, model, f"steady {i} " * 10, 300)))
                await asyncio.sleep(0.1)
            assert await watch.wait_for(lambda latest: latest[b].num_running >= 4, 10), watch.latest[b]
            spread = (watch.latest[a].num_running, watch.latest[b].num_running)
            results = await asyncio.gather(*burst, *steady)
    assert all(r["error"] is None and r["finish"] == "length" for r in results)
    assert abs(spread[0] - spread[1]) <= 6, spread
    assert sum(len(watch.publishers(r["id"])) > 1 for r in results) >= 3


@pytest.mark.parametrize("victim", ["destination", "source"])
async def test_killed_instance_mid_stage(cluster, llumlets, victim):
    """SIGKILL during a (bandwidth-capped, so long) stage. Destination killed: the request goes
    on at the source and completes. Source killed: the destination's lease expires and its
    blocks come back, and the gateway resumes the request there by recompute (its holder died):
    the client still gets every token."""
    slow = ("--sim-num-blocks", "400", "--sim-kv-bytes-per-token", "2048", "--migration-bandwidth-mib-s", "2",
            "--migration-lease-s", "1")
    src, dst = llumlets(*slow), llumlets(*slow)
    async with Watch(cluster.nats_url) as watch:
        await wait_ready(cluster, watch, src, dst)
        await watch.order(dst, DrainOrder(drain=True))
        assert await watch.wait_for(lambda latest: latest[dst].draining, 5)
        model = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            request = asyncio.create_task(stream_chat(http, model, "long context " * 300, 1200))
            assert await watch.wait_for(lambda latest: latest[src].num_running == 1, 10)
            await watch.order(dst, DrainOrder(drain=False))
            await asyncio.sleep(0.2)
            await watch.order(src, MigrateOrder(f"test-{victim}", dst))
            assert await watch.wait_for(lambda latest: latest[dst].reserved_blocks > 0, 5), "no migration started"
            baseline = watch.latest[dst if victim == "source" else src].num_blocks_total
            cluster.procs[dst if victim == "destination" else src].kill()
            result = await request
        if victim == "destination":
            assert result["error"] is None and result["finish"] == "length"
            assert result["usage"]["completion_tokens"] == 1200
            assert watch.publishers(result["id"]) == [src]
            survivor = src
        else:
            assert result["error"] is None and result["finish"] == "length", result["error"]
            assert result["usage"]["completion_tokens"] == 1200
            assert watch.publishers(result["id"])[-1] == dst
            survivor = dst
        assert await watch.wait_for(lambda latest: all_free(latest, survivor), 5), watch.latest[survivor]
        assert watch.latest[survivor].num_blocks_free == baseline
