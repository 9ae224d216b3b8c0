"""Cache-aware migration between two real vLLM llumlets (issue 18 §4): the destination served
the same prompt before, so its prefix cache holds the prompt's full blocks; a request with that
prompt migrates into it mid-decode, and those blocks do not cross the wire (the source's counters
say how many were skipped and how many bytes went), while the output stays exactly the unmigrated
run's and every block comes back on both sides. With prefix caching off nothing is skipped.

Requests go straight to a llumlet over NATS (so the test knows where each runs); the migration
is ordered directly (MigrateOrder), with the scheduler's pairing off.
"""

from __future__ import annotations

import contextlib
import re
import uuid

import httpx
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import subjects
from shared.messages import Ack, GenerateRequest, MigrateOrder, SamplingParams, decode, decode_chunks, encode
from tests.support.cluster import Cluster, free_port
from tests.support.observer import NatsObserver
from tests.support.polling import poll

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # (minutes of real vLLM: CI's `slow` run)

BLOCK_SIZE = 128  # vLLM's CPU default
PROMPT = [(29 * i) % 370 + 7 for i in range(3 * BLOCK_SIZE + 20)]  # 3 full blocks and 20 tokens
PROMPT_BLOCKS = len(PROMPT) // BLOCK_SIZE
OUTPUT_LEN = 400
MOVE_AFTER = 150  # output tokens: 554 computed, the 4th block (prompt tail + output) full
KV_BYTES_PER_TOKEN = 1024  # the tiny model (tests/vllm/helpers.py)
SOURCE, DESTINATION = "pc-src", "pc-dst"
LLUMLET = ("--max-model-len", "2048", "--vllm-kv-cache-gib", "0.02", "--report-interval-s", "0.05",
           "--migration-min-residence-s", "0", "--migration-min-return-s", "0")


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def cluster(request, tiny_model_dir, tmp_path_factory):
    from shared.embedded_nats import start_nats

    caching = "--vllm-prefix-caching" if request.param else "--no-vllm-prefix-caching"
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path_factory.mktemp("vllm-migration-prefix-logs"))
    cluster.metrics_ports = {i: free_port() for i in (SOURCE, DESTINATION)}
    cluster.prefix_caching = request.param
    try:
        cluster.start_scheduler("--no-enable-migration")
        for instance_id, port in cluster.metrics_ports.items():
            cluster.start_llumlet(instance_id, *LLUMLET, caching, "--metrics-port", str(port), engine="vllm")
        cluster.start_gateway()
        cluster.wait_ready(instances=2, timeout_s=300)
        yield cluster
    finally:
        cluster.stop()
        server.stop()


class Streams:
    """Requests sent straight to a llumlet; their chunks on one reply subject."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.subject = f"test.prefix.{uuid.uuid4().hex[:8]}"
        self.tokens: dict[str, dict[int, int]] = {}
        self.publishers: dict[str, list[str]] = {}
        self.done: set[str] = set()

    async def start(self) -> Streams:
        async def on_chunks(msg) -> None:
            for chunk in decode_chunks(msg.data):
                seen = self.tokens.setdefault(chunk.request_id, {})
                new = [i for i in range(len(chunk.token_ids)) if chunk.start_index + i not in seen]
                for i, token in enumerate(chunk.token_ids):
                    assert seen.setdefault(chunk.start_index + i, token) == token, "conflicting duplicate"
                owners = self.publishers.setdefault(chunk.request_id, [])
                if new and owners[-1:] != [chunk.instance_id]:
                    owners.append(chunk.instance_id)
                if chunk.finish_reason is not None:
                    self.done.add(chunk.request_id)

        await self.nc.subscribe(self.subject, cb=on_chunks)
        return self

    async def submit(self, instance_id: str, request_id: str, max_tokens: int) -> None:
        request = GenerateRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True), self.subject)
        reply = await self.nc.request(subjects.llumlet(instance_id, "generate"), encode(request), timeout=10)
        assert decode(reply.data, Ack).ok

    def output(self, request_id: str) -> list[int]:
        seen = self.tokens.get(request_id, {})
        assert sorted(seen) == list(range(len(seen))), "gap in the stream"
        return [seen[i] for i in range(len(seen))]

    async def until(self, predicate, timeout_s: float) -> bool:
        return await poll(predicate, timeout_s)


def counters(cluster: Cluster, instance_id: str) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_ports[instance_id]}/metrics", timeout=5).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("corral:llumlet_migration")}


def all_free(latest) -> bool:
    return all(i in latest and latest[i].num_blocks_free == latest[i].num_blocks_total
               and latest[i].reserved_blocks == 0 and latest[i].num_running == 0 and latest[i].num_migrating == 0
               for i in (SOURCE, DESTINATION))


async def test_a_prefix_cached_at_the_destination_is_not_sent(cluster):
    async with NatsObserver(cluster.nats_url) as observer, contextlib.AsyncExitStack() as stack:
        nc = await nats.connect(cluster.nats_url)
        stack.push_async_callback(nc.close)
        streams = await Streams(nc).start()
        assert await observer.wait_for(all_free, 30), observer.latest
        await streams.submit(SOURCE, "unmigrated", OUTPUT_LEN)
        await streams.submit(DESTINATION, "warm", 4)  # the destination caches the prompt's full blocks
        assert await streams.until(lambda: {"unmigrated", "warm"} <= streams.done, 120)
        before = counters(cluster, SOURCE)

        await streams.submit(SOURCE, "moved", OUTPUT_LEN)
        assert await streams.until(lambda: len(streams.tokens.get("moved", {})) >= MOVE_AFTER, 60)
        pair = f"test-{uuid.uuid4().hex[:8]}"
        await nc.publish(subjects.llumlet(SOURCE, "migrate"), encode(MigrateOrder(pair, DESTINATION)))
        moved = await streams.until(lambda: streams.publishers["moved"][-1:] == [DESTINATION], 20)
        await nc.publish(subjects.llumlet(SOURCE, "migrate"), encode(MigrateOrder(pair, DESTINATION, cancel=True)))
        assert moved, streams.publishers["moved"]
        assert await streams.until(lambda: "moved" in streams.done, 120)

        assert streams.publishers["moved"] == [SOURCE, DESTINATION]
        assert streams.output("moved") == streams.output("unmigrated")
        assert len(streams.output("moved")) == OUTPUT_LEN
        assert await observer.wait_for(all_free, 15), observer.latest  # leases, pins and held blocks all back

    (line,) = re.findall(r"migrated moved to \S+ .*KV: (\d+) of (\d+) blocks sent \((\d+) bytes for (\d+) tokens\), "
                         r"(\d+) cached there", cluster.procs[SOURCE].log())
    sent, lease_blocks, num_bytes, num_tokens, cached = map(int, line)
    after = counters(cluster, SOURCE)

    def delta(name: str) -> float:
        return after[f"corral:llumlet_migration_{name}_total"] - before[f"corral:llumlet_migration_{name}_total"]

    print(f"prefix caching {cluster.prefix_caching}: {sent} of {lease_blocks} blocks sent, {num_bytes} bytes, "
          f"{cached} cached at the destination")
    assert cached == (PROMPT_BLOCKS if cluster.prefix_caching else 0)
    assert delta("blocks_cached") == cached
    assert delta("blocks_sent") == sent == lease_blocks - cached
    # vLLM's CPU cache moves by whole blocks (no token frames: tests/vllm/test_vllm_kv_layout.py).
    assert delta("kv_bytes_sent") == num_bytes == sent * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    assert (sent - 2) * BLOCK_SIZE < num_tokens <= sent * BLOCK_SIZE
    assert counters(cluster, DESTINATION)["corral:llumlet_migration_blocks_sent_total"] == 0
