"""Prefill/decode disaggregation live (issue 19 §2), as the client sees it: two simulated
llumlets behind the real scheduler and gateway, once as two mixed instances and once as one
prefill + one decode instance, the same seeded arrivals against each, side by side.

    .venv/bin/python -m benchmarks.pd_live [--requests 40] [--rate 2] [--prompt-tokens 1500]
        [--output-tokens 150] [--time-scale 1] [--out results/pd_live.json]

Per configuration (client side, from SSE event arrival times): TTFT P50/P99, the gap between
events (TBT) P50/P99 over all requests, each request's largest gap (the hand-off's stall on a
P/D request) P50/P99, and the llumlets' `corral:llumlet_handoffs_total{outcome}`. The simulated
engine runs modelled A10 steps (`--time-scale` 1: real modelled time), so TTFT and TBT reflect the
batch each instance runs (a P/D decode instance never runs a prefill beside its decodes); the
hand-off itself moves real bytes over loopback. Two instances only: this measures the live
mechanism, not the best prefill/decode ratio (the simulator's benchmark sweeps that).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.llumlet.engines import model_vocabulary
from services.tools.make_model import ensure_tiny_model
from shared.embedded_nats import start_nats
from tests.support.cluster import Cluster, free_port

CONFIGS = {"mixed": ("mixed", "mixed"), "pd": ("prefill", "decode")}


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, at: float) -> dict:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent = time.monotonic()
    arrivals: list[float] = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return {"error": f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"}
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                arrivals.append(time.monotonic())
    if not arrivals:
        return {"error": "no tokens"}
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft_s": arrivals[0] - sent, "gaps_s": gaps, "max_gap_s": max(gaps, default=0.0)}


def handoffs(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "corral:llumlet_handoffs_total"}


def run_config(name: str, roles: tuple[str, str], model_dir: Path, args: argparse.Namespace, work: Path) -> dict:
    nats = start_nats()
    cluster = Cluster(nats.url, model_dir, work / f"logs-{name}")
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in roles]
    try:
        cluster.start_scheduler()
        for i, (role, port) in enumerate(zip(roles, ports)):
            cluster.start_llumlet(f"{name}-{i}", "--role", role, "--sim-time-scale", str(args.time_scale),
                                  "--max-model-len", "8192", "--metrics-port", str(port))
        cluster.start_gateway()
        cluster.wait_ready(instances=len(roles))
        vocab, _eos, _ = model_vocabulary(str(model_dir))
        rng = random.Random(args.seed)
        start = time.monotonic() + 0.5
        schedule, at = [], start
        for i in range(args.requests):
            at += rng.expovariate(args.rate)
            prompt = [rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens)]
            schedule.append((prompt, at))

        async def drive() -> list[dict]:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=600) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                return await asyncio.gather(*(one_request(http, model, p, args.output_tokens, t) for p, t in schedule))

        results = asyncio.run(drive())
        outcomes = {f"{name}-{i}": handoffs(port) for i, port in enumerate(ports)}
    finally:
        cluster.stop()
        nats.stop()
    done = [r for r in results if "error" not in r]
    gaps = [g for r in done for g in r["gaps_s"]]
    return {
        "config": name, "roles": list(roles), "requests": len(results), "completed": len(done),
        "errors": sorted({r["error"] for r in results if "error" in r}),
        "ttft_p50_s": quantile([r["ttft_s"] for r in done], 0.5), "ttft_p99_s": quantile([r["ttft_s"] for r in done], 0.99),
        "tbt_p50_s": quantile(gaps, 0.5), "tbt_p99_s": quantile(gaps, 0.99),
        "max_gap_p50_s": quantile([r["max_gap_s"] for r in done], 0.5),
        "max_gap_p99_s": quantile([r["max_gap_s"] for r in done], 0.99),
        "tbt_mean_s": statistics.fmean(gaps) if gaps else None,
        "handoffs": outcomes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--output-tokens", type=int, default=150)
    parser.add_argument("--time-scale", type=float, default=1.0, help="the llumlets' --sim-time-scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="mixed,pd")
    parser.add_argument("--out", default="results/pd_live.json")
    args = parser.parse_args()
    model_dir = ensure_tiny_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pd-live-") as tmp:
        for name in args.configs.split(","):
            rows.append(run_config(name, CONFIGS[name], model_dir, args, Path(tmp)))
    ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"  # noqa: E731
    print("milliseconds, client side;  max gap = each request's largest gap between events")
    print(f"{'config':6} {'done':>6} {'TTFT p50':>9} {'p99':>7} {'TBT p50':>8} {'p99':>7} {'max gap p50':>12} {'p99':>7}"
          "  hand-offs")
    for r in rows:
        outcomes: dict[str, float] = {}
        for by_outcome in r["handoffs"].values():
            for outcome, n in by_outcome.items():
                outcomes[outcome] = outcomes.get(outcome, 0) + n
        said = ", ".join(f"{k} {v:.0f}" for k, v in outcomes.items() if v) or "none"
        print(f"{r['config']:6} {r['completed']:>3}/{r['requests']:<3}{ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>7} "
              f"{ms(r['tbt_p50_s']):>8} {ms(r['tbt_p99_s']):>7} {ms(r['max_gap_p50_s']):>12} {ms(r['max_gap_p99_s']):>7}"
              f"  {said}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
