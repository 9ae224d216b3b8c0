"""loadgen against Corral (simulated engine) and against vLLM's own OpenAI server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.cluster import REPO, free_port

TRACES = REPO.parent / "shared" / "data" / "traces"
VLLM_FIELDS = [
    "date", "endpoint_type", "backend", "model_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
]


def run_loadgen(endpoint: str, model: str, tokenizer, out, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "loadgen.cli", "run", "--endpoint", endpoint, "--model", model,
           "--tokenizer", str(tokenizer), "--result-file", str(out), "--no-progress", *extra]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


@pytest.mark.skipif(not (TRACES / "BurstGPT_1.csv").exists(), reason="the handouts' traces are not beside the repo")
def test_loadgen_replays_a_trace_against_corral(sim_cluster, tiny_model_dir, tmp_path):
    model = httpx.get(f"{sim_cluster.base_url}/v1/models").json()["data"][0]["id"]
    result = run_loadgen(
        sim_cluster.base_url, model, tiny_model_dir, tmp_path / "corral.json",
        "--dataset", f"burstgpt:{TRACES / 'BurstGPT_1.csv'}", "--num-requests", "20",
        "--request-rate", "20", "--max-tokens", "16", "--ignore-eos",
    )
    for name in VLLM_FIELDS:
        assert name in result, name
    assert result["completed"] == 20 and result["failed"] == 0
    assert result["total_output_tokens"] == 20 * 16
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"]


@pytest.mark.vllm
@pytest.mark.slow
def test_loadgen_against_vllms_own_server(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    port = free_port()
    log = open(tmp_path / "vllm.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
         "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            raise AssertionError("vLLM server did not start")
        result = run_loadgen(
            f"http://127.0.0.1:{port}", str(tiny_model_dir), tiny_model_dir, tmp_path / "vllm.json",
            "--dataset", "random:64:16", "--num-requests", "10", "--ignore-eos",
        )
        assert result["completed"] == 10 and result["total_output_tokens"] == 160
        for name in VLLM_FIELDS:
            assert name in result, name
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
