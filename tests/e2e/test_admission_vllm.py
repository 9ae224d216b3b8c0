"""Admission control live on the vLLM engine (issue 19 §1): a scheduler with `--admission
predicted`, one vLLM llumlet (the tiny model, a KV cache of 6 blocks of 128 tokens) and the
gateway. A burst of prompts, each needing 3 of its blocks, gets 429s with Retry-After for what
cannot fit, the admitted are served, each with the TTFT the scheduler predicted compared at the
gateway, and the llumlet's reports carry what `predicted` reads (output so far, finished requests
with their output, step pace)."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest

from shared.embedded_nats import start_nats
from tests.e2e.test_admission_live import late_error_bound
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

KV_GIB = 6 * 128 * 1024 / (1 << 30)  # 6 blocks of 128 tokens at 1 KiB per token
VLLM_ARGS = ("--max-model-len", "512", "--vllm-kv-cache-gib", f"{KV_GIB:.10f}", "--vllm-max-num-seqs", "8",
             "--report-interval-s", "0.05")
SCHEDULER = ("--admission", "predicted", "--slo-ttft-s", "1.0", "--slo-tbt-s", "0.5")
PROMPT_TOKENS = 300  # 3 blocks with the first token: one fits (vLLM keeps one of the 6 as its null block)
MAX_TOKENS = 40
BURST = 10


@pytest.fixture
def cluster(tiny_model_dir, tmp_path):
    nats_server = start_nats()
    cluster = Cluster(nats_server.url, tiny_model_dir, tmp_path)
    cluster.start_scheduler(*SCHEDULER)
    cluster.start_llumlet("adm-vllm", *VLLM_ARGS, engine="vllm")
    cluster.start_gateway()
    try:
        cluster.wait_ready(instances=1, timeout_s=240)
        yield cluster
    finally:
        cluster.stop()
        nats_server.stop()


def test_a_burst_on_a_vllm_instance_is_admitted_as_it_fits(cluster):
    async def burst():
        async with NatsObserver(cluster.nats_url) as observer:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                body = {"model": model, "prompt": [100] * PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                        "ignore_eos": True, "temperature": 0}
                replies = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(BURST)))
                served = sum(r.status_code == 200 for r in replies)
                await observer.wait_for(lambda latest: sum(r.num_finished_total for r in latest.values()) >= served)
                return replies, [report for _, report in observer.reports], (await http.get("/metrics")).text

    replies, reports, metrics = asyncio.run(burst())
    served = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    assert len(served) + len(refused) == BURST, [(r.status_code, r.text[:200]) for r in replies]
    assert 1 <= len(served) <= 3 and refused  # one fits at once; another once it finished, at most
    for reply in refused:
        assert int(reply.headers["retry-after"]) >= 1 and "SLO" in reply.json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in served)

    bound, late, early = late_error_bound(metrics)
    assert late + early == len(served)  # every admitted request came with its predicted TTFT

    last = reports[-1]
    assert last.num_finished_total == len(served)
    assert last.finished_output_tokens_total == len(served) * MAX_TOKENS
    assert any(report.running_output_tokens and max(report.running_output_tokens) > 0 for report in reports)
    # The pace is reported while the instance decodes (an idle one forgets it: ServedTally.went_idle).
    assert any(r.step_time_s > 0 and r.step_decode_batch >= 1 and r.step_decode_context >= PROMPT_TOKENS
               for r in reports)
