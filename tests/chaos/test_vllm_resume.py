"""Resume by recompute with the vLLM engine: a vLLM llumlet SIGKILLed mid-decode, its greedy
requests continue on the other with exactly the text a fault-free run gives."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest

from tests.chaos.harness import dead_processes, judge, model_name, stream_completion, wait_blocks_back
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # (a minute of real vLLM: CI's `slow` run)
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

VLLM_ARGS = ("--max-model-len", "512", "--vllm-kv-cache-gib", "0.01", "--vllm-max-num-seqs", "16")
STREAMS = 8
TOKENS = 480  # ~1 s of decoding on a quiet machine: the kill must land mid-decode (200 finished first)


def prompts() -> list[list[int]]:
    return [[1 + (i * 11 + j) % 300 for j in range(12 + i)] for i in range(STREAMS)]


async def test_vllm_instance_killed_mid_decode_resumes_with_identical_greedy_output(chaos_nats, tiny_model_dir,
                                                                                    tmp_path):
    cluster = Cluster(chaos_nats.url, tiny_model_dir, tmp_path)
    cluster.start_scheduler()
    for i in range(2):
        cluster.start_llumlet(f"vllm-{i}", *VLLM_ARGS, "--no-enable-migration", engine="vllm")
    cluster.start_gateway()
    try:
        cluster.wait_ready(instances=2, timeout_s=240)
        name = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
            reference = await asyncio.gather(*(stream_completion(http, name, p, TOKENS) for p in prompts()))
            assert all(o.completed for o in reference), [o.error for o in reference]
            async with NatsObserver(cluster.nats_url) as observer:
                tasks = [asyncio.create_task(stream_completion(http, name, p, TOKENS)) for p in prompts()]
                assert await observer.wait_for(lambda latest: "vllm-1" in latest and latest["vllm-1"].num_running >= 2,
                                               30)
                cluster.procs["vllm-1"].kill()
                outcomes = await asyncio.gather(*tasks)
        tally = judge(outcomes, [o.text for o in reference])
        resumed = {line for line in cluster.procs["gateway"].log().splitlines() if "resumed on" in line}
        print(f"\nvLLM SIGKILL: {tally.line()} resumed {len(resumed)}")
        assert tally.completed == STREAMS and tally.wrong == 0, tally
        assert resumed, "the killed instance held requests, none resumed"
        assert not (left := await wait_blocks_back(cluster.nats_url, ["vllm-0"])), left
        assert dead_processes(cluster, "vllm-1") == []
    finally:
        cluster.stop()
