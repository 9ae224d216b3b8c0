"""The benchmark clients client_agreement.py runs against one Corral: how each is invoked
(vLLM's own `vllm bench serve`, loadgen, AIPerf) and how its results file is read back into one
shape (metric_stat in ms, throughputs, counts)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


METRICS = ("ttft", "tpot", "itl", "e2el")


STATS = ("mean", "median", "p99")


THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")


COUNTS = ("completed", "failed", "total_input_tokens", "total_output_tokens")


# AIPerf's metric tags → vLLM's metric names (see the module docstring for why ITL maps to TPOT).
AIPERF_METRICS = {
    "time_to_first_token": "ttft",
    "inter_token_latency": "tpot",
    "inter_chunk_latency": "itl",
    "request_latency": "e2el",
}


AIPERF_THROUGHPUTS = {"request_throughput": "request_throughput", "output_token_throughput": "output_throughput"}


def vllm_bench_argv(args: argparse.Namespace, base_url: str, model: str, model_dir: Path, out_dir: Path) -> list[str]:
    return [sys.executable, str(args.vllm_bench), "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base_url,
            "--model", model, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--ignore-eos",
            "--num-prompts", str(args.num_requests), "--request-rate", str(args.request_rate),
            "--seed", str(args.seed), "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(out_dir), "--result-filename", "vllm_bench.json"]


def loadgen_argv(args: argparse.Namespace, base_url: str, model: str, model_dir: Path, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "loadgen.cli", "run", "--endpoint", base_url, "--model", model,
            "--tokenizer", str(model_dir), "--dataset", f"random:{args.input_len}:{args.output_len}",
            "--num-requests", str(args.num_requests), "--request-rate", str(args.request_rate),
            "--ignore-eos", "--seed", str(args.seed), "--percentiles", "50,90,99", "--no-progress",
            "--label", "client_agreement", "--result-file", str(out_dir / "loadgen.json")]


def aiperf_argv(args: argparse.Namespace, base_url: str, model: str, model_dir: Path, out_dir: Path) -> list[str]:
    # --use-server-token-count: the random-weight model's text does not re-tokenize to the
    # number of tokens generated, so counting output tokens client-side would skew TPOT.
    return [str(args.aiperf), "profile", "--model", model, "--url", base_url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(model_dir), "--use-server-token-count",
            "--synthetic-input-tokens-mean", str(args.input_len), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.output_len), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--request-count", str(args.num_requests),
            "--request-rate", str(args.request_rate), "--random-seed", str(args.seed),
            "--artifact-dir", str(out_dir / "aiperf"), "--ui-type", "none"]


def read_vllm_style(path: Path) -> dict[str, float]:
    """vllm bench serve's result file, and loadgen's (the same field names)."""
    data = json.loads(path.read_text())
    wanted = [f"{s}_{m}_ms" for m in METRICS for s in STATS] + list(THROUGHPUTS) + list(COUNTS)
    return {key: float(data[key]) for key in wanted if isinstance(data.get(key), (int, float))}


def read_aiperf(out_dir: Path) -> dict[str, float]:
    paths = sorted((out_dir / "aiperf").rglob("profile_export_aiperf.json"))
    if not paths:
        raise FileNotFoundError(f"no profile_export_aiperf.json under {out_dir / 'aiperf'}")
    data = json.loads(paths[-1].read_text())
    found = _aiperf_metrics(data)
    figures: dict[str, float] = {}
    for tag, name in AIPERF_METRICS.items():
        record = found.get(tag)
        if record:
            scale = _to_ms(record.get("unit", "ms"))
            for ours, theirs in (("mean", "avg"), ("median", "p50"), ("p99", "p99")):
                if isinstance(record.get(theirs), (int, float)):
                    figures[f"{ours}_{name}_ms"] = record[theirs] * scale
    for tag, name in AIPERF_THROUGHPUTS.items():
        record = found.get(tag)
        if record and isinstance(record.get("avg"), (int, float)):
            figures[name] = float(record["avg"])
    for tag, name in (("request_count", "completed"), ("error_request_count", "failed")):
        record = found.get(tag)
        if record and isinstance(record.get("avg"), (int, float)):
            figures[name] = float(record["avg"])
    return figures


def _aiperf_metrics(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """AIPerf's export: metric records keyed by tag, at the top level or under `records`."""
    records = data.get("records", data)
    if isinstance(records, list):
        return {r.get("tag"): r for r in records if isinstance(r, dict)}
    return {tag: r for tag, r in records.items() if isinstance(r, dict)}


def _to_ms(unit: str) -> float:
    return {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1000.0, "sec": 1000.0}.get(str(unit).lower(), 1.0)


CLIENTS = {
    "vllm_bench": (vllm_bench_argv, lambda out: read_vllm_style(out / "vllm_bench.json")),
    "loadgen": (loadgen_argv, lambda out: read_vllm_style(out / "loadgen.json")),
    "aiperf": (aiperf_argv, read_aiperf),
}
