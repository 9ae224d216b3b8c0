"""Admission control live (issue 19 §1), as the client sees it: two simulated llumlets behind the
real scheduler and gateway, square-wave bursts past what they can serve within the SLO, once per
admission policy, the same seeded requests against each, side by side.

    .venv/bin/python -m benchmarks.admission_live [--bursts 3] [--burst-size 40] [--gap-s 3]
        [--prompt-tokens 1000] [--output-tokens 32] [--slo-ttft-s 1] [--slo-tbt-s 0.2]
        [--shared-prefix-tokens 0] [--policies none,current-load,predicted] [--out results/admission_live.json]

Per policy, client side: how many were admitted, refused with 429, or failed otherwise; how long a
refusal took from the request's send to its status line (P50/P90/P99/max: the issue asks for a
429 within 100 ms of arrival); whether every 429 carried `Retry-After` and `retry-after-ms`;
admitted requests' TTFT P50/P99 and the share within the TTFT target, and how far the gateway
measured them from admission's predictions (`corral:gateway_ttft_prediction_error_seconds`: its
mean, measured less predicted). `--shared-prefix-tokens N` opens every prompt with the same N
tokens, the llumlets caching prefixes and the gateway sending block hashes, so admission predicts
a cached prompt by its uncached rest. The simulated engine runs
modelled A10 steps at real time, so a queue of prefills is a real wait. Timing on a shared 2-core
machine includes the client's own scheduling: read the refusal figures as upper bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.pd_live import quantile
from services.llumlet.engines import model_vocabulary
from services.tools.make_model import ensure_tiny_model
from shared.config import non_negative_int
from shared.embedded_nats import start_nats
from tests.support.cluster import Cluster, free_port

INSTANCES = 2


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, at: float) -> dict:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        status_after_s = time.monotonic() - sent
        if reply.status_code == 429:
            await reply.aread()
            return {"status": 429, "refused_after_s": status_after_s,
                    "retry_after": reply.headers.get("retry-after"),
                    "retry_after_ms": reply.headers.get("retry-after-ms")}
        if reply.status_code != 200:
            return {"status": reply.status_code, "error": (await reply.aread())[:200].decode(errors="replace")}
        first_token_s = None
        async for line in reply.aiter_lines():
            if first_token_s is None and line.startswith("data: {") and '"text"' in line:
                first_token_s = time.monotonic() - sent
    return {"status": 200, "ttft_s": first_token_s}


def run_policy(policy: str, schedule: list[tuple[list[int], float]], model_dir: Path,
               args: argparse.Namespace, work: Path) -> dict:
    nats = start_nats()
    cluster = Cluster(nats.url, model_dir, work / f"logs-{policy}")
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    admission = () if policy == "none" else (
        "--admission", policy, "--slo-ttft-s", str(args.slo_ttft_s), "--slo-tbt-s", str(args.slo_tbt_s))
    metrics_port = free_port()
    caching = ("--sim-prefix-caching",) if args.shared_prefix_tokens else ()
    hashes = ("--dispatch-prefix-hashes", "true") if args.shared_prefix_tokens else ()
    try:
        cluster.start_scheduler(*admission, "--metrics-port", str(metrics_port))
        for i in range(INSTANCES):
            cluster.start_llumlet(f"{policy}-{i}", "--max-model-len", "8192", *caching)
        cluster.start_gateway(*hashes)
        cluster.wait_ready(instances=INSTANCES)

        async def drive() -> list[dict]:
            start = time.monotonic() + 0.5
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=600,
                                         limits=httpx.Limits(max_connections=None)) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                return await asyncio.gather(*(one_request(http, model, p, args.output_tokens, start + t)
                                              for p, t in schedule))

        results = asyncio.run(drive())
        reasons = rejection_reasons(metrics_port)
        prediction_error = mean_prediction_error(cluster.base_url)
    finally:
        cluster.stop()
        nats.stop()
    refused = [r for r in results if r["status"] == 429]
    admitted = [r for r in results if r["status"] == 200]
    ttfts = [r["ttft_s"] for r in admitted if r["ttft_s"] is not None]
    waits = [r["refused_after_s"] for r in refused]
    return {
        "policy": policy, "sent": len(results), "admitted": len(admitted), "refused": len(refused),
        "failed": [r for r in results if r["status"] not in (200, 429)],
        "refusal_p50_s": quantile(waits, 0.5), "refusal_p90_s": quantile(waits, 0.9),
        "refusal_p99_s": quantile(waits, 0.99), "refusal_max_s": max(waits, default=None),
        "refusals_within_100ms": sum(w <= 0.1 for w in waits),
        "refusals_with_retry_headers": sum(bool(r["retry_after"] and r["retry_after_ms"]) for r in refused),
        "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p99_s": quantile(ttfts, 0.99),
        "admitted_within_ttft_slo": sum(t <= args.slo_ttft_s for t in ttfts),
        "rejections_by_reason": reasons, "ttft_prediction_error_mean_s": prediction_error,
        "admitted_per_burst": [sum(r["status"] == 200 for r in results[b * args.burst_size:(b + 1) * args.burst_size])
                               for b in range(args.bursts)],
    }


def rejection_reasons(port: int) -> dict[str, float]:
    """The scheduler's `corral:scheduler_admission_rejections_total` by reason (nonzero ones)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "corral:scheduler_admission_rejections_total" and s.value}


def mean_prediction_error(base_url: str) -> float | None:
    """The gateway's mean of measured less predicted TTFT over admitted requests (None: none)."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    sums, count = {"late": 0.0, "early": 0.0}, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("corral:gateway_ttft_prediction_error_seconds"):
                continue
            if sample.name.endswith("_sum"):
                sums[sample.labels["direction"]] += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return (sums["late"] - sums["early"]) / count if count else None


def square_wave(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], float]]:
    """`--burst-size` requests spread over 0.2 s, every `--gap-s`, `--bursts` times (seeded); each
    prompt opens with the same `--shared-prefix-tokens`."""
    rng = random.Random(args.seed)
    shared = [rng.randrange(100, vocab - 1) for _ in range(args.shared_prefix_tokens)]
    schedule = []
    for burst in range(args.bursts):
        for _ in range(args.burst_size):
            prompt = shared + [rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens - len(shared))]
            schedule.append((prompt, burst * args.gap_s + rng.uniform(0.0, 0.2)))
    return schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--burst-size", type=int, default=40)
    parser.add_argument("--gap-s", type=float, default=3.0, help="seconds between bursts")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft-s", type=float, default=1.0)
    parser.add_argument("--slo-tbt-s", type=float, default=0.2)
    parser.add_argument("--shared-prefix-tokens", type=non_negative_int, default=0,
                        help="every prompt opens with the same this many tokens (of --prompt-tokens); the llumlets "
                             "cache prefixes and the gateway sends block hashes (0: unique prompts)")
    parser.add_argument("--policies", default="none,current-load,predicted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/admission_live.json")
    args = parser.parse_args()
    if args.shared_prefix_tokens > args.prompt_tokens:
        parser.error("--shared-prefix-tokens must be at most --prompt-tokens")
    model_dir = ensure_tiny_model()
    vocab, _eos, _ = model_vocabulary(str(model_dir))
    schedule = square_wave(args, vocab)
    rows = []
    with tempfile.TemporaryDirectory(prefix="admission-live-") as tmp:
        for policy in args.policies.split(","):
            rows.append(run_policy(policy, schedule, model_dir, args, Path(tmp)))
    ms = lambda v: "-" if v is None else f"{1e3 * v:.0f}"  # noqa: E731
    print(f"{len(schedule)} requests in {args.bursts} bursts of {args.burst_size}, {args.prompt_tokens} prompt tokens; "
          f"SLO TTFT {args.slo_ttft_s:g} s, TBT {args.slo_tbt_s:g} s; {INSTANCES} simulated A10 llumlets; ms, client side")
    print(f"{'policy':13} {'admitted':>8} {'429':>5} {'other':>5}  {'429 after p50':>13} {'p90':>5} {'p99':>5} {'max':>5}"
          f" {'<=100ms':>8} {'headers':>8}  {'TTFT p50':>8} {'p99':>6} {'in SLO':>7}")
    for r in rows:
        print(f"{r['policy']:13} {r['admitted']:>8} {r['refused']:>5} {len(r['failed']):>5}  "
              f"{ms(r['refusal_p50_s']):>13} {ms(r['refusal_p90_s']):>5} {ms(r['refusal_p99_s']):>5} "
              f"{ms(r['refusal_max_s']):>5} {r['refusals_within_100ms']:>8} {r['refusals_with_retry_headers']:>8}  "
              f"{ms(r['ttft_p50_s']):>8} {ms(r['ttft_p99_s']):>6} {r['admitted_within_ttft_slo']:>4}/{r['admitted']}"
              f"   per burst {r['admitted_per_burst']}, refused by {r['rejections_by_reason'] or '-'}, "
              f"prediction error mean {ms(r['ttft_prediction_error_mean_s'])}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
