"""Where a load point's decode latency comes from: is a gap between policies the decode steps,
or a few requests' preemption stalls?

    .venv/bin/python -m benchmarks.decode_tail [--trace S-L] [--rate 8] [--step-mode v1]
        [--requests 3000] [--seeds 0,1,2,3] [--out results/decode_tail.json]

Decode latency is Llumnix's (BENCHMARKS.md): per request, the time from its first token to its
last over its output tokens after the first, then the mean (and P99) over requests. It counts
everything after the first token: a preempted request's wait in the queue and its recompute,
and a migration's downtime. On a heavy-tailed output trace (S-L: median output 58 tokens, 10 %
of requests 2 tokens) one request of 2 tokens preempted just after its first token and left
waiting 90 s adds 90 s / 2,800 requests = 32 ms to the mean on its own. This runs one
`paper_repro` point (same traces, cluster, policies, control) and splits each run's decode
latency: requests preempted after their first token against the others, the mean with each
request's preemption loss taken out, the share of the mean that the `--top` worst requests
make, the mean over outputs of at least `--min-output` tokens, and the short-output requests
preempted. `corral-no-migration` is Corral with migration off (same dispatch, same queue).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.paper_repro import TRACES, policy_and_config
from benchmarks.ten_percent_rule import CONTROL
from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.workload import WorkloadSpec, build_workload

NO_MIGRATION = "corral-no-migration"
POLICIES = ("corral", NO_MIGRATION, "infaas++", CONTROL)


def split_decode(result, top: int, min_output: int) -> dict:
    """The run's decode latency taken apart (ms); see the module docstring."""
    rows = [r for r in result.finished if r.num_output_tokens > 1]
    per = np.array([(r.finished_time - r.first_token_time) / (r.num_output_tokens - 1) for r in rows])
    loss = np.array([r.preemption_loss_s / (r.num_output_tokens - 1) for r in rows])
    # The loss also counts a preemption before the first token, which decode latency does not
    # include: where prompts are preempted in prefill this takes out too much (capped at the
    # request's decode time). At the S-L points every preemption lands in decode.
    loss = np.minimum(loss, per)
    hit = np.array([r.num_preemptions > 0 for r in rows])
    short = np.array([r.num_output_tokens < min_output for r in rows])
    worst = np.sort(per)[::-1][:top]
    ms = lambda xs: float(np.mean(xs) * 1000) if len(xs) else 0.0  # noqa: E731
    return {
        "requests": len(rows),
        "mean_ms": ms(per),
        "p99_ms": float(np.percentile(per, 99) * 1000),
        "mean_without_preemption_loss_ms": ms(per - loss),
        "preempted_requests": int(hit.sum()),
        "preempted_mean_ms": ms(per[hit]),
        "not_preempted_mean_ms": ms(per[~hit]),
        f"top{top}_share_of_mean_ms": float(worst.sum() / len(per) * 1000),
        f"mean_output_ge_{min_output}_ms": ms(per[~short]),
        f"preempted_output_lt_{min_output}": int((hit & short).sum()),
        f"preempted_output_lt_{min_output}_share_of_mean_ms": float(per[hit & short].sum() / len(per) * 1000),
        "num_preemptions": result.num_preemptions,
        "migrations": result.migrations.committed,
    }


def run(args: argparse.Namespace) -> list[dict]:
    trace = next(t for t in TRACES if t.name == args.trace)
    cluster = SimConfig().with_scheduler(step_mode=args.step_mode)
    rows = []
    for seed in args.seeds:
        spec = WorkloadSpec(trace.dataset, num_requests=args.requests, rate=args.rate, cv=trace.cv, seed=seed)
        workload = build_workload(spec, cluster.max_seq_len)
        for name in POLICIES:
            if name == NO_MIGRATION:
                policy, config = policy_and_config("corral", cluster)
                policy = replace(policy, migration=False)
            else:
                policy, config = policy_and_config(name, cluster)
            result = ClusterSimulator(config, policy, workload).run()
            row = {"seed": seed, "policy": name, **split_decode(result, args.top, args.min_output)}
            rows.append(row)
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def seed_averaged(rows: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for row in rows:
        by.setdefault(row["policy"], []).append(row)
    keys = [k for k in rows[0] if k not in ("seed", "policy")]
    return {name: {k: float(np.mean([r[k] for r in runs])) for k in keys} for name, runs in by.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="S-L", choices=[t.name for t in TRACES])
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--step-mode", choices=("v0", "v1"), default="v1")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3])
    parser.add_argument("--top", type=int, default=5, help="the worst requests whose share of the mean is shown")
    parser.add_argument("--min-output", type=int, default=10, help="outputs shorter than this count as short")
    parser.add_argument("--out", default="results/decode_tail.json", help="(results/ is git-ignored)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(args)
    averaged = seed_averaged(rows)
    base = averaged["infaas++"]
    print(f"\nseed-averaged over {len(args.seeds)} seeds, ratio to INFaaS++:")
    for name, values in averaged.items():
        print(f"  {name:<20}" + "  ".join(
            f"{k} {v:.1f} ({v / base[k]:.2f}x)" if base[k] else f"{k} {v:.1f}" for k, v in values.items()))
    document = {"settings": {k: v for k, v in vars(args).items()}, "seed_averaged": averaged, "runs": rows,
                "elapsed_s": time.perf_counter() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
