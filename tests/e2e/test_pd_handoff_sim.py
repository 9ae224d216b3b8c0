"""Prefill/decode disaggregation as a live migration (issue 19 §2), end to end: real scheduler,
gateway and simulated llumlets (one `--role prefill`, one `--role decode`) over real NATS.

The reference for "identical tokens" is the simulated engine's own stream for the request
(`SyntheticTokens`: a function of the request id and the seed only), i.e. what the request
outputs when it never migrates; the text is its decoding.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from services.llumlet.engines import model_vocabulary
from services.llumlet.engines.sim.engine import SyntheticTokens
from shared.embedded_nats import start_nats
from shared.messages import InstanceRole
from shared.policy.migration import DEFAULT_MAX_IN
from tests.e2e.test_corral_up import stop_up
from tests.e2e.test_corral_up_metrics import free_port_run
from tests.e2e.test_migration_sim import Watch, all_free, model_name, stream_chat, wait_ready
from tests.support.cluster import REPO, Cluster, free_port

SIM = ("--sim-time-scale", "0.05", "--max-model-len", "4096", "--report-interval-s", "0.05")
INSTANCE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """NATS, the scheduler and a gateway; each test starts its own llumlets (ids of their own)."""
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path_factory.mktemp("pd-logs"))
    cluster.start_scheduler("--instance-timeout-s", str(INSTANCE_TIMEOUT_S))
    cluster.start_gateway("--instance-timeout-s", str(INSTANCE_TIMEOUT_S))
    try:
        yield cluster
    finally:
        cluster.stop()
        server.stop()


@pytest.fixture
def llumlets(cluster):
    started: list[str] = []

    def start(role: str, *extra: str) -> str:
        instance_id = f"{role}-{uuid.uuid4().hex[:6]}"
        cluster.start_llumlet(instance_id, *SIM, "--role", role, *extra)
        started.append(instance_id)
        return instance_id

    yield start
    for instance_id in started:
        cluster.procs[instance_id].terminate()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    vocab, eos, _ = model_vocabulary(str(tiny_model_dir))
    tokens = SyntheticTokens(vocab, eos, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def expected(request_id: str, n: int) -> tuple[list[int], str]:
        key = tokens.key(request_id)
        ids = [tokens.token(key, i) for i in range(n)]
        return ids, tokenizer.decode(ids, skip_special_tokens=True)

    return expected


def first_token_from(watch: Watch, request_id: str) -> str:
    return next(c.instance_id for c in watch.chunks[request_id] if c.start_index == 0 and c.token_ids)


async def test_requests_stream_unbroken_across_the_handoff_and_free_their_prefill_blocks(cluster, llumlets, reference):
    prefill, decode = llumlets("prefill"), llumlets("decode")
    n = 1500
    async with Watch(cluster.nats_url) as watch:
        await wait_ready(cluster, watch, prefill, decode)
        assert watch.latest[prefill].role is InstanceRole.PREFILL and watch.latest[decode].role is InstanceRole.DECODE
        model = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
            requests = [asyncio.create_task(stream_chat(http, model, f"story {i} " * 40, n)) for i in range(3)]
            # All three decode on the decode instance while the prefill instance holds nothing:
            # their prefill blocks were freed at the hand-off's commit, not at the end.
            handed = await watch.wait_for(lambda latest: latest[decode].num_running == 3
                                          and all_free(latest, prefill), 30)
            assert handed, (watch.latest[prefill], watch.latest[decode])
            results = await asyncio.gather(*requests)
        assert await watch.wait_finished(*(r["id"] for r in results))
        for result in results:
            assert result["error"] is None and result["finish"] == "length", result["error"]
            assert result["usage"]["completion_tokens"] == n
            ids, text = reference(result["id"], n)
            assert watch.tokens(result["id"]) == ids  # no gap, no duplicate, the unmigrated stream
            assert result["text"] == text
            # Dispatched to the prefill instance, which streamed the first token; then the decode one.
            assert watch.publishers(result["id"]) == [prefill, decode]
            assert first_token_from(watch, result["id"]) == prefill
        assert await watch.wait_for(lambda latest: all_free(latest, prefill, decode), 10), watch.latest
        # Its reports count the migrations it answered, the three hand-offs' and any it refused
        # busy (asked again): the scheduler counts its hand-offs off by it.
        assert watch.latest[decode].num_migrations_asked_total >= 3
        assert watch.latest[prefill].num_migrations_asked_total == 0
        # And how many it takes in at once: the scheduler hands off only to one under it.
        assert watch.latest[decode].max_migrations_in == DEFAULT_MAX_IN and watch.latest[decode].num_migrating_in == 0


async def test_with_no_room_on_the_decode_instance_the_request_finishes_on_its_prefill_instance(
        cluster, llumlets, reference):
    """The decode instance's 40 blocks cannot take a ~600-token prompt and keep the guard's
    margin free: the scheduler names no destination and the request decodes where it is."""
    prefill, decode = llumlets("prefill"), llumlets("decode", "--sim-num-blocks", "40")
    n = 300
    async with Watch(cluster.nats_url) as watch:
        await wait_ready(cluster, watch, prefill, decode)
        model = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
            result = await stream_chat(http, model, "long context " * 200, n)
        assert await watch.wait_finished(result["id"])
        assert result["error"] is None and result["finish"] == "length", result["error"]
        ids, text = reference(result["id"], n)
        assert watch.tokens(result["id"]) == ids and result["text"] == text
        assert watch.publishers(result["id"]) == [prefill]
        assert watch.latest[decode].reserved_blocks == 0 and watch.latest[decode].num_migrating == 0
        assert watch.latest[decode].num_migrations_asked_total == 0  # (none asked of it)
        assert await watch.wait_for(lambda latest: all_free(latest, prefill, decode), 10), watch.latest


def counter(metrics_url: str, name: str, label: str, value: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and sample.labels[label] == value)


def migrations(metrics_url: str, direction: str) -> float:
    return counter(metrics_url, "corral:llumlet_migrations_total", "direction", direction)


def test_corral_up_prefill_and_decode_hands_requests_off(tiny_model_dir, tmp_path):
    """`corral up --prefill 1 --decode 1`: llumlet-0 prefills, llumlet-1 decodes what it hands off."""
    port, metrics = free_port(), free_port_run(3)
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--engine", "sim", "--prefill", "1",
                               "--decode", "1", "--port", str(port), "--model", str(tiny_model_dir),
                               "--metrics-port", str(metrics), "--sim-time-scale", "0.1"],
                              cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while httpx_get_json(f"http://127.0.0.1:{port}/healthz").get("instances") != 2:
            assert up.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.3)
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        for i in range(2):
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
                "model": model, "messages": [{"role": "user", "content": f"tell me {i} " * 20}], "max_tokens": 200})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 200
        prefill_url, decode_url = (f"http://127.0.0.1:{metrics + i}/metrics" for i in (1, 2))
        assert (migrations(prefill_url, "out"), migrations(decode_url, "in")) == (2, 2)
        assert (migrations(prefill_url, "in"), migrations(decode_url, "out")) == (0, 0)
        assert counter(prefill_url, "corral:llumlet_handoffs_total", "outcome", "handed_off") == 2
        assert counter(prefill_url, "corral:llumlet_handoffs_total", "outcome", "no_room") == 0
        stop_up(up, tmp_path)
    finally:
        if up.poll() is None:
            up.kill()


def httpx_get_json(url: str) -> dict:
    try:
        return httpx.get(url, timeout=1).json()
    except (httpx.HTTPError, ValueError):
        return {}
