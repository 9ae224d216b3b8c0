"""How `loadgen simulate` grows with the fleet and the trace: wall time, CPU time and peak memory of
one policy run for each (instances, requests) point, each in a fresh process.

    .venv/bin/python -m benchmarks.sim_scaling [--instances 16 100 1000] [--requests 10000 30000 100000]
        [--policy corral] [--dispatch index scan] [--out results/sim_scaling.json]

The request rate grows with the fleet (`--rate-per-instance`, default 11/16: the ShareGPT load just
below saturation that benchmarks/sim_speed.py uses on 16 instances), so every point is equally
busy per instance. Two sweeps: instances at the smallest request count, and requests at the
largest fleet. The exponent printed for each sweep is the slope of log(cost) against log(size):
1.0 is linear. A point past --budget-s of wall time stops its sweep; the rest are extrapolated
linearly from the marginal cost between its last two points (marked `extrapolated` in the JSON):
the first point of a sweep is partly warm-up (an empty fleet filling), so a power law through it
understates the cost of long runs.

`--dispatch index scan` runs every point both ways, side by side: `index` is the simulator's
default (freeness dispatch through the live scheduler's `DispatchIndex`), `scan` scores every
instance's report per arrival (the simulator before it used the index). Decisions are the same
(tests/simulator/test_dispatch_view.py), so the runs differ only in cost; the step counts printed
must match.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_one(instances: int, requests: int, rate: float, policy: str, dataset: str, dispatch: str = "index") -> dict:
    """In this process: one simulated run; its costs."""
    from loadgen.simulator.cluster import ClusterSimulator
    from loadgen.simulator.config import SimConfig
    from shared.policy.baselines import get_policy
    from loadgen.simulator.workload import WorkloadSpec, build_workload

    base_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    config = SimConfig(num_instances=instances)
    started, cpu = time.perf_counter(), time.process_time()
    workload = build_workload(WorkloadSpec(dataset, num_requests=requests, rate=rate), config.max_seq_len)
    built = time.perf_counter() - started
    result = ClusterSimulator(config, get_policy(policy), workload, dispatch_index=dispatch == "index").run()
    return {
        "instances": instances, "requests": requests, "rate": rate, "policy": policy, "dispatch": dispatch,
        "wall_s": time.perf_counter() - started, "workload_build_s": built, "cpu_s": time.process_time() - cpu,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_after_imports_mb": base_rss_mb,
        "steps": result.num_steps, "virtual_span_s": result.makespan_s, "finished": len(result.finished),
        "migrations_committed": result.migrations.committed,
    }


_measured: dict[tuple[int, int, str], dict] = {}  # a point both sweeps share runs once


def _in_child(instances: int, requests: int, dispatch: str, args: argparse.Namespace) -> dict:
    key = (instances, requests, dispatch)
    if key not in _measured:
        _measured[key] = _run_child(instances, requests, dispatch, args)
    return _measured[key]


def _run_child(instances: int, requests: int, dispatch: str, args: argparse.Namespace) -> dict:
    rate = args.rate_per_instance * instances
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.sim_scaling", "--one", str(instances), str(requests), str(rate),
         args.policy, args.dataset, dispatch],
        cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def slope(points: list[dict], size_key: str, cost_key: str) -> float | None:
    """Least-squares exponent of cost against size (log-log)."""
    xs = [math.log(p[size_key]) for p in points]
    ys = [math.log(max(p[cost_key], 1e-9)) for p in points]
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def sweep(name: str, sizes: list[tuple[int, int]], size_key: str, dispatch: str, args: argparse.Namespace) -> dict:
    name = f"{name} ({dispatch})"
    points = []
    for instances, requests in sizes:
        point = _in_child(instances, requests, dispatch, args)
        points.append(point)
        print(f"  {name}: {instances:>5} instances {requests:>8} requests  wall {point['wall_s']:8.1f} s  "
              f"cpu {point['cpu_s']:8.1f} s  peak RSS {point['peak_rss_mb']:7.0f} MB  steps {point['steps']}",
              flush=True)
        if point["wall_s"] > args.budget_s:
            break
    fit = {cost: slope(points, size_key, cost) for cost in ("cpu_s", "peak_rss_mb")}
    extrapolated = []
    for instances, requests in sizes[len(points):]:
        size = instances if size_key == "instances" else requests
        guess = {"instances": instances, "requests": requests, "extrapolated": True}
        if len(points) >= 2:  # linear from the last two points' marginal cost (the first may be warm-up)
            prev, last = points[-2], points[-1]
            for cost in fit:
                per_unit = (last[cost] - prev[cost]) / (last[size_key] - prev[size_key])
                guess[cost] = last[cost] + per_unit * (size - last[size_key])
            extrapolated.append(guess)
            print(f"  {name}: {instances:>5} instances {requests:>8} requests  (extrapolated, linear in the last "
                  f"two points' marginal cost) cpu ~{guess['cpu_s']:.0f} s  peak RSS ~{guess['peak_rss_mb']:.0f} MB")
    print(f"  {name}: CPU time grows as size^{fit['cpu_s'] or float('nan'):.2f}, "
          f"peak memory as size^{fit['peak_rss_mb'] or float('nan'):.2f}")
    return {"points": points, "extrapolated": extrapolated, "exponents": fit}


def compare(runs: dict[str, dict]) -> list[dict]:
    """Index against scan on the points both measured (not extrapolated ones)."""
    def measured(mode: str) -> dict[tuple[int, int], dict]:
        return {(p["instances"], p["requests"]): p
                for sweep_ in runs[mode].values() for p in sweep_["points"]}
    index, scan = measured("index"), measured("scan")
    rows = []
    print("  index vs scan (CPU s; the same simulation: steps and finished requests must match)")
    for key in sorted(index.keys() & scan.keys()):
        a, b = index[key], scan[key]
        same = (a["steps"], a["finished"], a["migrations_committed"]) == (b["steps"], b["finished"],
                                                                          b["migrations_committed"])
        row = {"instances": key[0], "requests": key[1], "index_cpu_s": a["cpu_s"], "scan_cpu_s": b["cpu_s"],
               "speedup": b["cpu_s"] / a["cpu_s"], "index_peak_rss_mb": a["peak_rss_mb"],
               "scan_peak_rss_mb": b["peak_rss_mb"], "same_simulation": same}
        rows.append(row)
        print(f"    {key[0]:>5} instances {key[1]:>8} requests  index {a['cpu_s']:7.1f}  scan {b['cpu_s']:7.1f}  "
              f"x{row['speedup']:.2f}  peak RSS {a['peak_rss_mb']:.0f} / {b['peak_rss_mb']:.0f} MB"
              f"{'' if same else '  DIFFERENT SIMULATIONS'}")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--one":
        instances, requests, rate, policy, dataset, dispatch = argv[1:7]
        print(json.dumps(run_one(int(instances), int(requests), float(rate), policy, dataset, dispatch)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, nargs="+", default=[16, 100, 1000])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000, 30_000, 100_000, 1_000_000])
    parser.add_argument("--rate-per-instance", type=float, default=11 / 16)
    parser.add_argument("--policy", default="corral")
    parser.add_argument("--dataset", default="synthetic:sharegpt")
    parser.add_argument("--dispatch", nargs="+", choices=["index", "scan"], default=["index"],
                        help="the simulator's dispatch: the index (default), the scan, or both side by side")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop a sweep after a point this long")
    parser.add_argument("--out", default=str(ROOT / "results" / "sim_scaling.json"))
    args = parser.parse_args(argv)

    print(f"{args.policy}, {args.dataset}, {args.rate_per_instance:.3f} requests/s per instance")
    runs = {}
    for dispatch in args.dispatch:  # one mode's sweeps, then the next's: each point alone in its process
        runs[dispatch] = {
            "by_instances": sweep("instances", [(n, min(args.requests)) for n in args.instances], "instances",
                                  dispatch, args),
            "by_requests": sweep("requests", [(max(args.instances), r) for r in args.requests], "requests",
                                 dispatch, args),
        }
    comparison = compare(runs) if len(runs) == 2 else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "index_vs_scan": comparison}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
