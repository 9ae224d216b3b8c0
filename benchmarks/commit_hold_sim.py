"""The commit hold across a fleet, in the simulator (issue 20): each migration's stall (the
request's last token on its source to its first on the destination) and what the holds cost the
destinations' other requests, with the hold off, at its default (noticed a step ahead: hold or
not; half a step, 50 ms at most), noticed three steps ahead (`--migration-notice-steps 3`: the
destination paces its steps to meet the commit) and at a whole step, on several traces and seeds.

    .venv/bin/python -m benchmarks.commit_hold_sim [--instances 8] [--requests 1500] [--seeds 0 1]
        [--out results/commit_hold_sim.json]

Corral's policy (it migrates) at two rates per trace, chosen to keep the fleet loaded without a
queue that never drains. The same rules as the llumlets (`loadgen/simulator/handover.py`), with
one difference: the simulator's notice is exact, where a live source estimates its last stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loadgen.simulator.cluster import ClusterSimulator, SimResult
from loadgen.simulator.config import SimConfig
from loadgen.simulator.metrics import ClassMetrics
from loadgen.simulator.workload import WorkloadSpec, build_workload
from shared.engine_model.config import SchedulerConfig
from shared.policy.baselines import get_policy
from shared.policy.commit_hold import DEFAULT_HOLD, DEFAULT_NOTICE_STEPS, CommitHoldRule

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
# (dataset, Poisson rates per instance in req/s)
WORKLOADS = (
    (f"sharegpt:{TRACES / 'sharegpt_val_10k_llama2.csv'}", (1.6, 2.0)),
    (f"azure:{TRACES / 'AzureLLMInferenceTrace_conv.csv'}", (0.7, 0.8)),
    ("conversation:long", (0.15, 0.2)),
)
# name -> (the hold's rule, the notice's steps ahead)
HOLDS = {"off": (CommitHoldRule(), 1), "default": (DEFAULT_HOLD, DEFAULT_NOTICE_STEPS),
         "3 ahead": (DEFAULT_HOLD, 3), "whole step": (CommitHoldRule(1.0, 1.0), 1)}


@dataclass(frozen=True)
class Row:
    dataset: str
    rate: float
    seed: int
    hold: str
    migrations: int
    stall_p50_ms: float
    stall_p90_ms: float
    stall_p99_ms: float
    holds: int
    mean_hold_ms: float
    held_request_ms_per_migration: float  # the others' price: hold x requests held, per migration
    tbt_p99_ms: float  # per request: (last token - first) / (tokens - 1)
    ttft_p99_s: float
    preemptions: int


def row(dataset: str, rate: float, seed: int, hold: str, result: SimResult) -> Row:
    m = result.migrations
    stall = np.array(m.stall_s or [0.0]) * 1e3
    latencies = ClassMetrics.of(result.finished)  # (decode: a request's mean gap between tokens)
    return Row(dataset.split(":")[0] if "/" in dataset else dataset, rate, seed, hold, m.committed,
               float(np.percentile(stall, 50)), float(np.percentile(stall, 90)), float(np.percentile(stall, 99)),
               m.holds, 1e3 * m.held_s / m.holds if m.holds else 0.0,
               1e3 * m.held_request_s / m.committed if m.committed else 0.0,
               latencies.decode.p99_s * 1e3, latencies.prefill.p99_s, result.num_preemptions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=Path("results/commit_hold_sim.json"))
    args = parser.parse_args(argv)
    if args.instances < 1 or args.requests < 1:
        parser.error("--instances and --requests must be positive")
    started = time.monotonic()
    config = SimConfig(num_instances=args.instances, scheduler=SchedulerConfig(max_model_len=8192))
    rows: list[Row] = []
    print(f"{'dataset':<18} {'rate':>5} {'seed':>4} {'hold':<10} {'migr':>5} {'stall P50':>9} {'P90':>6} "
          f"{'P99':>6} {'holds':>5} {'hold':>6} {'others/migr':>11} {'TBT P99':>8} {'TTFT P99':>8} {'preempt':>7}")
    for dataset, per_instance in WORKLOADS:
        for rate in (r * args.instances for r in per_instance):
            for seed in args.seeds:
                try:
                    workload = build_workload(WorkloadSpec(dataset, num_requests=args.requests, rate=rate, seed=seed),
                                              config.max_seq_len)
                except FileNotFoundError as exc:
                    print(f"skipped {dataset}: {exc}", file=sys.stderr)
                    break
                for name, (rule, notice_steps) in HOLDS.items():
                    held = replace(config, migration=replace(config.migration, hold=rule, notice_steps=notice_steps))
                    r = row(dataset, rate, seed, name, ClusterSimulator(held, get_policy("corral"), workload).run())
                    rows.append(r)
                    print(f"{r.dataset:<18} {r.rate:>5.1f} {r.seed:>4} {r.hold:<10} {r.migrations:>5} "
                          f"{r.stall_p50_ms:>8.0f}ms {r.stall_p90_ms:>5.0f} {r.stall_p99_ms:>6.0f} {r.holds:>5} "
                          f"{r.mean_hold_ms:>5.1f} {r.held_request_ms_per_migration:>9.0f}ms "
                          f"{r.tbt_p99_ms:>6.0f}ms {r.ttft_p99_s:>7.2f}s {r.preemptions:>7}", flush=True)
    by = {}
    for r in rows:
        by.setdefault((r.dataset, r.rate, r.seed), {})[r.hold] = r
    better = sum(runs["default"].stall_p50_ms < runs["off"].stall_p50_ms for runs in by.values())
    print(f"\nthe default hold's stall median below the hold off's in {better} of {len(by)} runs")
    for what in ("stall_p50_ms", "stall_p90_ms", "held_request_ms_per_migration", "tbt_p99_ms", "ttft_p99_s",
                 "preemptions"):
        ratios = [runs["3 ahead"].__dict__[what] / runs["default"].__dict__[what] for runs in by.values()
                  if runs["default"].__dict__[what] > 0]
        if ratios:
            print(f"  {what}, three steps ahead / the default: median {np.median(ratios):.2f}x "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} runs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": {"instances": args.instances, "requests": args.requests,
                                                 "seeds": args.seeds,
                                                 "holds": {k: {**vars(rule), "notice_steps": steps}
                                                           for k, (rule, steps) in HOLDS.items()}},
                                    "rows": [vars(r) for r in rows], "wall_s": round(time.monotonic() - started, 1)},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
