"""Cache-aware migration in the simulator (issue 18 §4): bytes moved and migration time with and
without, on prefix-heavy workloads.

    .venv/bin/python -m benchmarks.migration_prefix [--instances 16] [--seeds 0] [--requests 400]
        [--workloads conversation,system-prompts,mooncake] [--rates 2,4]
        [--policies corral,corral-prefix] [--out results/migration_prefix.json]

16 × LLaMA-7B on A10 (the simulator's defaults), every instance with vLLM's prefix caching, the
same requests for each variant:
- `off`: migration copies every block of the request (as before);
- `skip`: the destination binds the request to the cached blocks of its prefix it already holds
  and only the rest is copied (pairing unchanged: `CacheAffinity(max_freeness_loss=0)`, a tie-break);
- `skip+pair`: also pairing's bounded preference for a destination holding the prefix
  (`CacheAffinity()`, within half the freest destination's freeness).

Workloads: `conversation` (conversation:long: each turn re-sends its session so far; no prefix is
shared between sessions), `system-prompts` (the same sessions, each opening with one of
`--system-prompts` shared system prompts of `--system-prompt-tokens`, seeded), and `mooncake`
(the Mooncake-format trace slice in /work/shared/data/traces, its 400 requests once; seed 0 its
own timestamps, other seeds Poisson gaps: benchmarks/prefix_workloads.py).

Per run: migrations committed, blocks copied, blocks the destination's cache held (not copied),
GiB moved, mean copy time of a migration (start to commit) and downtime (suspend to commit),
P99 TTFT, prefix hit rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.prefix_workloads import WORKLOADS, prefix_workload
from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.workload import Workload
from shared.policy.baselines import get_policy
from shared.policy.migration import CacheAffinity

VARIANTS = {
    "off": (False, CacheAffinity()),
    "skip": (True, CacheAffinity(max_freeness_loss=0.0)),
    "skip+pair": (True, CacheAffinity()),
}


def run_one(config: SimConfig, policy: str, workload: Workload, variant: str) -> dict:
    aware, affinity = VARIANTS[variant]
    config = replace(config, migration=replace(config.migration, cache_aware=aware, affinity=affinity))
    result = ClusterSimulator(config, get_policy(policy), workload).run()
    done, stats = result.finished, result.migrations
    ttft = np.array([r.first_token_time - r.arrival_time for r in done])
    prompt = sum(r.prompt_len for r in done)
    return {
        "policy": policy,
        "variant": variant,
        "completed": len(done),
        "migrations": stats.committed,
        "aborted": sum(stats.aborted.values()),
        "copied_blocks": stats.copied_blocks,
        "cached_blocks": stats.cached_blocks,
        "moved_gib": stats.copied_blocks * config.block_bytes / 2**30,
        "copied_per_migration": stats.copied_blocks / stats.committed if stats.committed else 0.0,
        "mean_copy_ms": 1e3 * float(np.mean(stats.duration_s)) if stats.duration_s else 0.0,
        "mean_downtime_ms": 1e3 * float(np.mean(stats.downtime_s)) if stats.downtime_s else 0.0,
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "hit_rate": sum(r.num_cached_tokens for r in done) / prompt if prompt else 0.0,
        "wall_s": result.wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--workloads", default="conversation,system-prompts,mooncake")
    parser.add_argument("--rates", default="2,4")
    parser.add_argument("--policies", default="corral,corral-prefix")
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-prompt-tokens", type=int, default=2048)
    parser.add_argument("--out", default="results/migration_prefix.json")
    args = parser.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [n for n in names if n not in WORKLOADS]:
        parser.error(f"unknown workload(s) {', '.join(unknown)}: choose from {', '.join(WORKLOADS)}")
    base = SimConfig(num_instances=args.instances)
    config = replace(base, scheduler=replace(base.scheduler, enable_prefix_caching=True))
    runs, started = [], time.perf_counter()
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in names:
            for rate in (float(r) for r in args.rates.split(",") if r.strip()):
                workload = prefix_workload(name, rate, seed, config.max_seq_len, conversation_requests=args.requests,
                                           system_prompts=args.system_prompts,
                                           system_prompt_tokens=args.system_prompt_tokens)
                for policy in (p.strip() for p in args.policies.split(",") if p.strip()):
                    for variant in VARIANTS:
                        row = {"workload": name, "rate": rate, "seed": seed,
                               **run_one(config, policy, workload, variant)}
                        runs.append(row)
                        print(f"{name:14s} {rate:4g}/s s{seed} {policy:13s} {variant:9s} "
                              f"migr {row['migrations']:4d}  copied {row['copied_blocks']:6d} blk "
                              f"({row['moved_gib']:6.2f} GiB, {row['copied_per_migration']:5.1f}/migr)  "
                              f"cached {row['cached_blocks']:5d} blk  "
                              f"copy {row['mean_copy_ms']:6.1f} ms  down {row['mean_downtime_ms']:5.1f} ms  "
                              f"TTFT p99 {row['ttft_p99_s']:6.2f}s  hit {row['hit_rate']:5.1%}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "wall_s": time.perf_counter() - started}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
