"""Live migration between two real vLLM llumlets (each its own process: vLLM's KV connector is
process-wide): with greedy sampling, a request migrated mid-decode, once or back and forth,
produces exactly the tokens it produces unmigrated, and every block comes back on both sides.

Migrations are ordered directly (a MigrateOrder to the source), with the scheduler's own pairing
off, so each test knows which moves happen.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from shared import subjects
from shared.messages import MigrateOrder, encode
from tests.support.cluster import Cluster, running_cluster
from tests.support.polling import poll
from tests.support.stream_watch import StreamWatch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # (minutes of real vLLM: CI's `slow` run)
REPO = Path(__file__).resolve().parents[2]
SELF_CHECK_PREFIX = "SELF-CHECK "

MAX_MODEL_LEN = 2048
OUTPUT_LEN = 1600  # long enough for several moves; blocks of 128 tokens: multi-stage copies
# Moves are ordered a fraction of a second apart, back and forth: no residence or return guard.
LLUMLET = ("--max-model-len", str(MAX_MODEL_LEN), "--vllm-kv-cache-gib", "0.02", "--report-interval-s", "0.05",
           "--migration-min-residence-s", "0", "--migration-min-return-s", "0")
INSTANCES = ("vm-a", "vm-b")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("vllm-migration-logs"), INSTANCES, *LLUMLET,
                         engine="vllm", scheduler_args=["--no-enable-migration"], timeout_s=240) as cluster:
        yield cluster


class Watch(StreamWatch):
    """Stream watch plus the orders this module's tests give."""

    def live_request(self) -> str | None:
        live = [rid for rid in self.chunks if not self.finished(rid)]
        return live[0] if len(live) == 1 else None

    async def until(self, predicate, timeout_s: float) -> bool:
        return await poll(predicate, timeout_s)

    async def move(self, request_id: str, src: str, dst: str, timeout_s: float = 10.0) -> None:
        """Pair src → dst until the request publishes from dst, then cancel the pair. The order is
        re-sent every half second, as the scheduler re-confirms its pairs: an order not confirmed
        within `pair_ttl_s` lapses (on a loaded machine the first may, before a migration starts)."""
        pair = f"test-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + timeout_s
        moved = False
        while not moved and time.monotonic() < deadline:
            await self.nc.publish(subjects.llumlet(src, "migrate"), encode(MigrateOrder(pair, dst)))
            moved = await self.until(lambda: self.publishers(request_id)[-1:] == [dst],
                                     min(0.5, max(0.0, deadline - time.monotonic())))
        await self.nc.publish(subjects.llumlet(src, "migrate"), encode(MigrateOrder(pair, dst, cancel=True)))
        assert moved, f"{request_id} did not move {src} → {dst}: {self.publishers(request_id)}"


def all_free(latest) -> bool:
    return all(
        i in latest and latest[i].num_blocks_free == latest[i].num_blocks_total and latest[i].reserved_blocks == 0
        and latest[i].num_running == 0 and latest[i].num_waiting == 0 and latest[i].num_migrating == 0
        for i in INSTANCES
    )


async def complete(http: httpx.AsyncClient, prompt: list[int]) -> dict:
    model = (await http.get("/v1/models")).json()["data"][0]["id"]
    reply = await http.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True,
    })
    assert reply.status_code == 200, reply.text
    return reply.json()


async def run_with_moves(cluster: Cluster, prompt: list[int], num_moves: int) -> None:
    async with Watch(cluster.nats_url) as watch, httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
        assert await watch.observer.wait_for(all_free, 30), watch.observer.latest
        reference = await complete(http, prompt)
        (reference_id,) = watch.chunks
        assert await watch.wait_finished(reference_id)
        expected = watch.tokens(reference_id)
        assert len(expected) == OUTPUT_LEN and len(watch.publishers(reference_id)) == 1

        task = asyncio.create_task(complete(http, prompt))
        assert await watch.until(lambda: watch.live_request() is not None, 30)
        request_id = watch.live_request()
        for move in range(num_moves):
            # Let it decode past a few more blocks first: the move copies them in stages.
            goal = (move + 1) * OUTPUT_LEN // (num_moves + 2)
            assert await watch.until(lambda: len(watch.tokens(request_id)) >= goal, 60)
            src = watch.publishers(request_id)[-1]
            await watch.move(request_id, src, next(i for i in INSTANCES if i != src))
        result = await task
        assert await watch.wait_finished(request_id)

        publishers = watch.publishers(request_id)
        assert len(publishers) == num_moves + 1, publishers
        assert watch.tokens(request_id) == expected
        assert result["choices"][0]["text"] == reference["choices"][0]["text"]
        assert result["usage"]["completion_tokens"] == OUTPUT_LEN
        # Every held, leased and allocated block is back, on both instances.
        assert await watch.observer.wait_for(all_free, 10), watch.observer.latest


def downtimes_ms(cluster: Cluster) -> list[float]:
    pattern = re.compile(r"migrated \S+ to \S+ in (\d+) stages \(downtime ([\d.]+) ms\)")
    return [float(m.group(2)) for i in INSTANCES for m in pattern.finditer(cluster.procs[i].log())]


async def test_migrated_once_mid_decode_continues_with_the_same_tokens(cluster):
    await run_with_moves(cluster, [(11 * i) % 200 + 5 for i in range(40)], num_moves=1)
    print("downtimes (ms):", downtimes_ms(cluster))


async def test_migrated_back_and_forth_continues_with_the_same_tokens(cluster):
    before = len(downtimes_ms(cluster))
    await run_with_moves(cluster, [(13 * i) % 250 + 3 for i in range(60)], num_moves=5)
    times = downtimes_ms(cluster)
    assert len(times) - before == 5, times
    print("downtimes (ms):", times)


# -- the adapter alone: one engine migrating requests into itself (no NATS, no sockets) -----------
# Run in a subprocess (`python -m tests.vllm.test_vllm_migration MODEL_DIR`): one vLLM engine per
# process. Prefix caching is off, so the destination loads every block through the connector.


def test_adapter_moves_resumes_and_frees_on_one_engine(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "tests.vllm.test_vllm_migration", str(tiny_model_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith(SELF_CHECK_PREFIX)]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[0].removeprefix(SELF_CHECK_PREFIX))
    assert result["migrated_matches"], result
    assert result["resumed_matches"], result
    assert not result["corrupted_matches"], "zeroed KV gave the same tokens: the check has no teeth"
    assert result["short_reservation"] is None
    assert result["free_after"] == result["free_before"] and result["reserved_after"] == 0, result
    assert len(result["seen_before_step"]) == 4, result
    for phase, physical, demand, lease_blocks in result["seen_before_step"]:
        assert (phase, physical, demand) == ("running", lease_blocks, 0), result["seen_before_step"]


def _view_of(engine, request_id: str, lease_blocks: int) -> list:
    """[phase, physical blocks, demand blocks, lease blocks] of the request's view in the report."""
    (view,) = [v for v in engine.request_views() if v.request_id == request_id]
    return [view.phase.value, view.physical_blocks, view.demand_blocks, lease_blocks]


async def _self_check(model_dir: str) -> dict:
    from services.llumlet.engines.vllm.engine import VllmEngine, VllmEngineConfig
    from services.llumlet.migration.copier import BlockCopier
    from shared.messages import GenerateRequest, SamplingParams

    block_size, output_len = 32, 80
    engine = VllmEngine(VllmEngineConfig(model_dir=model_dir, max_model_len=512, block_size=block_size,
                                         kv_cache_space_gib=64 * block_size * 1024 / (1 << 30),
                                         enable_prefix_caching=False))
    await engine.start()
    ops = engine.migration_ops()
    copier = BlockCopier(ops.kv_regions())  # the KV tensors exist once the engine started
    tokens: dict[str, dict[int, int]] = defaultdict(dict)
    finished: set[str] = set()
    seen_before_step: list[list] = []

    async def step_until(predicate) -> None:
        while not predicate():
            for out in await engine.step():
                tokens[out.request_id].update((out.start_index + i, t) for i, t in enumerate(out.token_ids))
                if out.finish_reason is not None:
                    finished.add(out.request_id)

    def add(request_id: str) -> None:
        engine.add_request(GenerateRequest(request_id, prompt, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                                             ignore_eos=True), "unused"))

    def output(request_id: str) -> list[int | None]:
        return [tokens[request_id].get(i) for i in range(output_len)]

    async def self_migrate(request_id: str, corrupt: bool = False) -> None:
        """Two stages into a lease on the same engine, then commit there."""
        lease = f"lease-{request_id}"
        await step_until(lambda: len(tokens[request_id]) >= 20)
        assert ops.migration_snapshot(request_id).max_num_tokens == len(prompt) + output_len
        full = ops.migration_snapshot(request_id).num_computed_tokens // block_size
        await copier.scatter(await ops.reserve_blocks(lease, full),
                             await copier.gather(ops.block_ids_of(request_id)[:full], 0))
        await step_until(lambda: len(tokens[request_id]) >= 30)
        assert await ops.suspend(request_id)
        rest = ops.block_ids_of(request_id)[full:]
        payload = await copier.gather(rest, 0)
        if corrupt:
            payload = bytes(len(payload))
        await copier.scatter(await ops.reserve_blocks(lease, len(rest)), payload)
        commit = ops.migration_commit(request_id, f"m-{request_id}")
        assert await ops.release_migrated(request_id)
        ops.add_migrated(commit, lease)
        # Before its first step here (queued for the engine thread, then in vLLM's queue) it is
        # reported running on its lease's blocks, not as a queued prompt.
        lease_blocks = full + len(rest)
        seen_before_step.append(_view_of(engine, request_id, lease_blocks))
        await engine.on_engine_thread(lambda driver: driver.apply_commands_and_snapshot())
        seen_before_step.append(_view_of(engine, request_id, lease_blocks))

    prompt = [(7 * i) % 300 + 3 for i in range(70)]
    add("reference")
    await step_until(lambda: "reference" in finished)
    free_before = engine.num_free_blocks()
    add("migrated")
    await self_migrate("migrated")
    add("corrupted")
    await self_migrate("corrupted", corrupt=True)
    add("resumed")
    await step_until(lambda: len(tokens["resumed"]) >= 25)
    assert await ops.suspend("resumed")
    assert await ops.resume("resumed")
    await step_until(lambda: {"migrated", "corrupted", "resumed"} <= finished)
    short = await ops.reserve_blocks("too-many", engine.num_blocks_total + 1)
    await ops.reserve_blocks("dropped", 3)
    assert ops.release_reservation("dropped") == 3  # (returns at once: the engine thread frees them next)
    await step_until(lambda: not engine.has_work())
    await engine.on_engine_thread(lambda driver: None)  # behind the release
    result = {
        "migrated_matches": output("migrated") == output("reference"),
        "corrupted_matches": output("corrupted") == output("reference"),
        "resumed_matches": output("resumed") == output("reference"),
        "short_reservation": short,
        "free_before": free_before,
        "free_after": engine.num_free_blocks(),
        "reserved_after": ops.num_reserved_blocks(),
        "seen_before_step": seen_before_step,
    }
    await engine.stop()
    return result


if __name__ == "__main__":
    print(SELF_CHECK_PREFIX + json.dumps(asyncio.run(_self_check(sys.argv[1]))), flush=True)
