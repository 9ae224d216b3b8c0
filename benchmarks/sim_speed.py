"""Speed of `loadgen simulate`: one policy run of N requests on K instances, per policy.

    .venv/bin/python -m benchmarks.sim_speed [--requests 10000] [--instances 16]
        [--dataset synthetic:sharegpt] [--rate 11] [--step-mode v1] [--policy corral,...] [--budget-s 10]
        [--out results/sim_speed.json]

The default workload is the heaviest of the paper's in tokens per request (ShareGPT lengths from
Table 1, ~500 output tokens each) at a rate just below saturation, where every mechanism is busy:
queues, preemptions, migrations. Prints wall and CPU time per run and whether it met the budget
(exit status 1 if one did not), and writes them as JSON. On a shared machine wall time includes
the other processes' share of the cores: CPU time is what the simulator itself costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.metrics import summarize
from loadgen.simulator.workload import WorkloadSpec, build_workload
from shared.policy.baselines import POLICY_NAMES, get_policy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--dataset", default="synthetic:sharegpt")
    parser.add_argument("--rate", type=float, default=11.0)
    parser.add_argument("--step-mode", default="v1", choices=("v1", "v0"))
    parser.add_argument("--priority-fraction", type=float, default=0.1)
    parser.add_argument("--policy", default=",".join(POLICY_NAMES))
    parser.add_argument("--budget-s", type=float, default=10.0)
    parser.add_argument("--out", default="results/sim_speed.json", help="(results/ is git-ignored)")
    args = parser.parse_args()

    config = SimConfig(num_instances=args.instances).with_scheduler(step_mode=args.step_mode)
    spec = WorkloadSpec(args.dataset, num_requests=args.requests, rate=args.rate,
                        priority_fraction=args.priority_fraction)
    workload = build_workload(spec, config.max_seq_len)
    print(f"{args.requests} requests ({workload.description}), {args.instances} instances, {args.step_mode}")
    over = False
    runs = []
    for name in args.policy.split(","):
        cpu = time.process_time()
        result = ClusterSimulator(config, get_policy(name), workload).run()
        cpu = time.process_time() - cpu
        metrics = summarize(result, config.block_bytes)
        over |= result.wall_s > args.budget_s
        runs.append({"policy": name, "wall_s": round(result.wall_s, 3), "cpu_s": round(cpu, 3),
                     "within_budget": result.wall_s <= args.budget_s, "steps": result.num_steps,
                     "migrations": metrics.migrations["committed"], "preemptions": result.num_preemptions,
                     "virtual_span_s": round(result.makespan_s, 1)})
        print(
            f"  {name:<13} wall {result.wall_s:5.2f} s (cpu {cpu:5.2f} s) "
            f"{'OK' if result.wall_s <= args.budget_s else 'OVER BUDGET'}: {result.num_steps} steps, "
            f"{metrics.output_tokens} output tokens, {metrics.migrations['committed']} migrations, "
            f"{result.num_preemptions} preemptions, virtual span {result.makespan_s:.0f} s, "
            f"P99 prefill {metrics.overall.prefill.p99_s:.2f} s"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"settings": settings, "workload": workload.description, "runs": runs}, indent=2))
    print(f"results: {out}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
