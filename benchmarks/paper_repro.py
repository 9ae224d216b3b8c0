"""Reproduce the Llumnix paper's serving experiments (§6.3–6.5) in the simulator.

    .venv/bin/python -m benchmarks.paper_repro [--requests 5000] [--seeds 2] [--jobs 2]
        [--out results/paper_repro.json] [--only L-L,ShareGPT,priorities,autoscale] [--quick]

16 × LLaMA-7B on A10 (851 blocks of 16 tokens), the paper's testbed step mode (v0: a prefill
stalls the batch), migration at 15 GB/s. For each trace (Table 1: S-S, M-M, L-L, S-L, L-S, and
ShareGPT-/BurstGPT-like lengths; Poisson arrivals, BurstGPT with Gamma CV 2) the request rate is
swept across the knee of the load curve: at the lowest rate P50 requests see no queueing, at the
highest INFaaS++'s P99 queueing is tens of seconds or more. Policies: Corral, round-robin,
INFaaS++, Llumnix-base, each on the same requests. Then: priorities (10 % high priority) and
auto-scaling (cost against P99).

The paper uses 10,000 requests per trace; the default here is 5,000 per point, each point run
with 2 seeds and the metrics averaged (near the knee a single seed's P99 swings by several
times between policies either way), so the whole run stays within ~15 minutes on 2 cores
(`--requests 10000 --seeds 1` for the paper's size). Prints a table per trace and the ratios the
paper reports, and writes everything as JSON.

The issue's hard rule: Corral no more than 10 % worse than INFaaS++ at any load point. Every
metric of the table is checked (mean and P99 of prefill, decode and end-to-end latency, and the
preemption loss where it exceeds 10 ms a request), seed-averaged. Near saturation a run is
chaotic: INFaaS++ against itself with its load reports 0.2 % further apart (the "control")
differs by up to 1.4x in P99 decode and 5x in P99 prefill at some points of 2 seeds. So each
point that breaks the rule is re-run on `--confirm-seeds` more seeds, with the control, and
reported with both numbers: "not confirmed" (within 10 % over all the seeds), "confirmed, but
within what the control shows", or "CONFIRMED" (beyond the control's own deviation too). One
control run is a single draw of that chaos, though: at S-L 7 req/s (3,000 requests, v1) Corral's
mean prefill over 32 seeds is 1.05x INFaaS++'s (90 % CI 0.85x-1.25x over seeds; the control
1.08x), yet a sample of 8 of those seeds lands above 1.10x in 41 % of draws (its first 8 gave
1.31x, "CONFIRMED" beyond a control of 0.89x). So a breach that still holds after the
confirmation seeds is escalated to `--escalate-seeds` more (same rule, more data), and every
verdict prints the 90 % confidence interval of its ratio over the seeds drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import AutoscaleModel, SimConfig
from loadgen.simulator.metrics import summarize
from loadgen.simulator.workload import WorkloadSpec, build_workload
from shared.policy.baselines import SchedulingPolicy, get_policy
from shared.policy.config import ScalingConfig
from benchmarks.ten_percent_rule import CONTROL, average, breaches, seed_ratios, annotate


POLICIES = ("corral", "round-robin", "infaas++", "llumnix-base")


@dataclass(frozen=True)
class Trace:
    name: str
    dataset: str
    rates: tuple[float, ...]
    cv: float = 1.0


TRACES = (
    Trace("S-S", "synthetic:S-S", (150, 190, 230)),
    Trace("M-M", "synthetic:M-M", (10, 14, 18)),
    Trace("L-L", "synthetic:L-L", (4.5, 5.0, 5.5)),
    Trace("S-L", "synthetic:S-L", (6, 7, 8)),
    Trace("L-S", "synthetic:L-S", (30, 40, 50)),
    Trace("ShareGPT", "synthetic:sharegpt", (10.5, 11.5, 12.5)),
    Trace("BurstGPT", "synthetic:burstgpt", (10, 12, 14), cv=2.0),
)
PRIORITY_POINTS = (("L-L", "synthetic:L-L", 5.0), ("ShareGPT", "synthetic:sharegpt", 12.5))
AUTOSCALE_POINT = ("ShareGPT Gamma CV 3", "synthetic:sharegpt", 7.0, 3.0)
AUTOSCALE_BANDS = ((5.0, 40.0), (10.0, 60.0), (20.0, 100.0))

PAPER_CLUSTER = SimConfig().with_scheduler(step_mode="v0")  # 16 × LLaMA-7B on A10, the paper's vLLM (v0 steps)


# -- one load point (runs in a worker process) ---------------------------------------------------


def policy_and_config(name: str, config: SimConfig) -> tuple[SchedulingPolicy, SimConfig]:
    if name == CONTROL:
        return get_policy("infaas++"), replace(config, report_interval_s=config.report_interval_s * 1.002)
    return get_policy(name), config


def run_point(job: tuple) -> list[dict]:
    """All policies on one workload, once per seed; returns JSON-ready metrics averaged over the
    seeds (small, to ship between processes), with the per-seed ones inside."""
    section, label, spec, policies, config, seeds = job
    per_seed: dict[str, list[dict]] = {name: [] for name in policies}
    for seed in seeds:
        workload = build_workload(replace(spec, seed=seed), config.max_seq_len)
        for name in policies:
            policy, policy_config = policy_and_config(name, config)
            result = ClusterSimulator(policy_config, policy, workload).run()
            per_seed[name].append(summarize(result, config.block_bytes).to_json() | {"policy": name})
    rows = []
    for name, runs in per_seed.items():
        row = {"section": section, "trace": label, "rate": spec.rate, "cv": spec.cv, **average(runs)}
        row["seeds"] = {str(seed): run for seed, run in zip(seeds, runs)}
        rows.append(row)
    return rows


def jobs(args: argparse.Namespace, cluster: SimConfig) -> list[tuple]:
    only = set(args.only.split(",")) if args.only else None
    seeds = tuple(range(args.seed, args.seed + args.seeds))
    todo = []
    for trace in TRACES:
        if only and trace.name not in only:
            continue
        rates = trace.rates[1:2] if args.quick else trace.rates
        for rate in rates:
            spec = WorkloadSpec(trace.dataset, num_requests=args.requests, rate=rate, cv=trace.cv, seed=args.seed)
            todo.append(("serving", trace.name, spec, POLICIES, cluster, seeds))
    if not only or "priorities" in only:
        for label, dataset, rate in PRIORITY_POINTS:
            spec = WorkloadSpec(dataset, num_requests=args.requests, rate=rate, priority_fraction=0.1, seed=args.seed)
            todo.append(("priorities", label, spec, ("corral", "llumnix-base", "infaas++"), cluster, seeds))
    if not only or "autoscale" in only:
        label, dataset, rate, cv = AUTOSCALE_POINT
        spec = WorkloadSpec(dataset, num_requests=args.requests, rate=rate, cv=cv, seed=args.seed)
        for low, high in AUTOSCALE_BANDS:
            scaling = ScalingConfig(scale_out_below=low, scale_in_above=high, sustain_s=2.0, cooldown_s=5.0,
                                    min_instances=1, max_instances=16)
            config = replace(cluster, num_instances=4, autoscale=AutoscaleModel(scaling=scaling, startup_s=10.0))
            todo.append((f"autoscale [{low:g},{high:g}]", label, spec, ("corral", "infaas++"), config, seeds))
        todo.append(("autoscale fixed 16", label, spec, ("corral", "infaas++"), cluster, seeds))
    return todo


# -- reporting -----------------------------------------------------------------------------------


def _fmt_row(row: dict, cls: str = "overall") -> str:
    m = row["overall"] if cls == "overall" else row["by_class"][cls]
    return (
        f"{row['policy']:<13}{'' if cls == 'overall' else ' ' + cls:<7} "
        f"{m['prefill']['mean_s']:>8.2f} {m['prefill']['p99_s']:>8.2f} "
        f"{m['decode']['mean_s'] * 1e3:>8.1f} {m['decode']['p99_s'] * 1e3:>8.1f} {m['e2e']['mean_s']:>8.1f} "
        f"{m['e2e']['p99_s']:>8.1f} {m['preemption_loss_mean_s']:>8.3f} {row['num_preemptions']:>7.0f} "
        f"{row['migrations']['committed']:>6.0f} {row['average_instances']:>6.2f}"
    )


HEADER = (
    f"{'policy':<20} {'pf mean':>8} {'pf P99':>8} {'dec mean':>8} {'dec P99':>8} {'e2e mean':>8} {'e2e P99':>8} "
    f"{'ploss':>8} {'#preem':>7} {'#migr':>6} {'#inst':>6}\n"
    f"{'':<20} {'s':>8} {'s':>8} {'ms':>8} {'ms':>8} {'s':>8} {'s':>8} {'s':>8}"
)

# -- the hard rule: Corral no more than 10 % worse than INFaaS++ -----------------------------------


def ratios(rows: list[dict]) -> dict:
    """Baseline / Corral per load point (>1: Corral is better)."""
    by_policy = {r["policy"]: r["overall"] for r in rows}
    corral = by_policy["corral"]
    out = {}
    for base in ("infaas++", "round-robin", "llumnix-base"):
        if base not in by_policy:
            continue
        b = by_policy[base]
        out[base] = {
            "prefill_mean": _ratio(b["prefill"]["mean_s"], corral["prefill"]["mean_s"]),
            "prefill_p99": _ratio(b["prefill"]["p99_s"], corral["prefill"]["p99_s"]),
            "decode_mean": _ratio(b["decode"]["mean_s"], corral["decode"]["mean_s"]),
            "decode_p99": _ratio(b["decode"]["p99_s"], corral["decode"]["p99_s"]),
            "e2e_mean": _ratio(b["e2e"]["mean_s"], corral["e2e"]["mean_s"]),
            "e2e_p99": _ratio(b["e2e"]["p99_s"], corral["e2e"]["p99_s"]),
            "preemption_loss_reduction": _reduction(corral["preemption_loss_mean_s"], b["preemption_loss_mean_s"]),
        }
    return out


def _reduction(ours: float, base: float) -> float | None:
    return 1 - ours / base if base > 0 else None


def _ratio(base: float, ours: float) -> float | None:
    return base / ours if ours > 0 else None


def report(all_rows: list[dict]) -> dict:
    summary: dict = {"points": [], "violations": []}
    sections = list(dict.fromkeys((r["section"], r["trace"], r["rate"]) for r in all_rows))
    current_trace = None
    for section, trace, rate in sections:
        rows = [r for r in all_rows if (r["section"], r["trace"], r["rate"]) == (section, trace, rate)]
        if (section, trace) != current_trace:
            current_trace = (section, trace)
            print(f"\n=== {section}: {trace} ({rows[0]['workload']})")
        print(f"--- {rate:g} req/s\n{HEADER}")
        for row in rows:
            print(_fmt_row(row))
            if section == "priorities":
                for cls in row["by_class"]:
                    print(_fmt_row(row, cls))
        if section == "serving":
            r = ratios(rows)
            summary["points"].append({"trace": trace, "rate": rate, "ratios": r})
            inf, rr = r["infaas++"], r["round-robin"]
            print(
                f"  Corral vs INFaaS++: prefill mean {_x(inf['prefill_mean'])} P99 {_x(inf['prefill_p99'])}, "
                f"decode mean {_x(inf['decode_mean'])} P99 {_x(inf['decode_p99'])}, e2e P99 {_x(inf['e2e_p99'])}; "
                f"vs round-robin: prefill mean {_x(rr['prefill_mean'])} P99 {_x(rr['prefill_p99'])}, "
                f"preemption loss {_pct(rr['preemption_loss_reduction'])}"
            )
            by_policy = {row["policy"]: row for row in rows}
            for label, ratio in breaches(by_policy["corral"]["overall"], by_policy["infaas++"]["overall"]):
                summary["violations"].append({
                    "trace": trace, "rate": rate, "cv": rows[0]["cv"], "metric": label, "ratio": ratio,
                    "seed_ratios": seed_ratios(by_policy, label),
                })
    return summary


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{-value:+.0%}"


def headline(summary: dict, all_rows: list[dict]) -> None:
    points = summary["points"]
    if points:
        best = lambda base, key: max((p["ratios"][base][key] or 0, p["trace"], p["rate"]) for p in points)  # noqa: E731
        losses = [p["ratios"]["round-robin"]["preemption_loss_reduction"] for p in points]
        losses = [x for x in losses if x is not None]
        print("\n=== Headline (paper → here)")
        for label, base, key, paper in (
            ("vs INFaaS++ P99 prefill", "infaas++", "prefill_p99", "up to 15x"),
            ("vs INFaaS++ mean prefill", "infaas++", "prefill_mean", "up to 7.7x"),
            ("vs INFaaS++ P99 decode", "infaas++", "decode_p99", "up to 2x"),
            ("vs INFaaS++ P99 e2e", "infaas++", "e2e_p99", "up to 2.9x (real traces)"),
            ("vs round-robin mean prefill", "round-robin", "prefill_mean", "up to 26.6x"),
            ("vs round-robin P99 prefill", "round-robin", "prefill_p99", "up to 34.4x"),
        ):
            value, trace, rate = best(base, key)
            print(f"  {label:<28} paper {paper:<24} here up to {value:.1f}x ({trace} @ {rate:g} req/s)")
        if losses:
            mean_change = -sum(losses) / len(losses)
            print(f"  {'preemption loss vs RR':<28} paper {'-84 % on average':<24} here {mean_change:+.0%} "
                  f"on average over the load points")
    prio = [r for r in all_rows if r["section"] == "priorities" and r["policy"] == "corral"]
    for row in prio:
        high, normal = row["by_class"]["high"], row["by_class"]["normal"]
        base = next(r for r in all_rows if r["section"] == "priorities" and r["trace"] == row["trace"]
                    and r["policy"] == "infaas++")["by_class"]["high"]
        faster = {key: normal[key]["mean_s"] / high[key]["mean_s"] for key in ("prefill", "decode", "e2e")}
        vs_infaas = base["e2e"]["mean_s"] / high["e2e"]["mean_s"]
        print(f"  high priority ({row['trace']}): e2e mean {faster['e2e']:.2f}x faster than normal (TTFT "
              f"{faster['prefill']:.1f}x, TPOT {faster['decode']:.2f}x), {vs_infaas:.2f}x faster than under "
              f"INFaaS++ (paper: up to 1.5x)")
    scaled = [r for r in all_rows if r["section"].startswith("autoscale")]
    if scaled:
        print(f"  auto-scaling ({scaled[0]['trace']}), average instances and P99 e2e per scaling band:")
        for section in dict.fromkeys(r["section"] for r in scaled):
            rows = {r["policy"]: r for r in scaled if r["section"] == section}
            print("    " + section + ": " + ", ".join(
                f"{name} {row['average_instances']:.2f} inst / {row['overall']['e2e']['p99_s']:.1f} s"
                for name, row in rows.items()))
        saving = cost_saving_at_similar_p99(scaled)
        print(f"  auto-scaling cost at similar P99 e2e (within 10 %): {saving} (paper: up to -36 %)")
    print_breaches(summary["violations"])


def print_breaches(violations: list[dict]) -> None:
    print("\n=== Load points where Corral is more than 10 % worse than INFaaS++ (any metric, seed-averaged)")
    for v in violations:
        line = f"  {v['trace']} @ {v['rate']:g}: {v['metric']} {v['ratio']:.2f}x (per seed {_xs(v['seed_ratios'])})"
        if "ratio_all" in v:
            low, high = v["ratio_ci90"]
            line += (f"; over {v['num_seeds_all']} seeds {v['ratio_all']:.2f}x (90 % CI over seeds {low:.2f}x to "
                     f"{high:.2f}x; per seed {min(v['seed_ratios_all']):.2f}x to {max(v['seed_ratios_all']):.2f}x), "
                     f"control {v['control_ratio']:.2f}x: " + _status(v))
        print(line)
    if not violations:
        print("  none")


def _status(v: dict) -> str:
    if not v["confirmed"]:
        return "not confirmed"
    return "CONFIRMED" if v["beyond_control_noise"] else "confirmed, but within what the control shows"


def _xs(values: list[float]) -> str:
    return " ".join(f"{value:.2f}x" for value in values)


def confirm_breaches(violations: list[dict], all_rows: list[dict], args: argparse.Namespace, cluster: SimConfig,
                     pool: ProcessPoolExecutor) -> None:
    """Re-run each point that broke the rule on `--confirm-seeds` more seeds, and the control on
    all of them; a point whose breach still holds over those seeds gets `--escalate-seeds` more
    (the same rule on more data: near the knee an 8-seed ratio of two equally good policies
    still lands above 1.10 often). Annotates every breach with its ratio over all its seeds."""
    first = tuple(range(args.seed, args.seed + args.seeds))
    rows = run_confirmation(violations, all_rows, args, cluster, pool, first, first, args.confirm_seeds)
    annotate(violations, rows)
    still = [v for v in violations if v["confirmed"]]
    if still and args.escalate_seeds > 0:
        done = first + tuple(range(first[-1] + 1, first[-1] + 1 + args.confirm_seeds))
        print(f"escalating {len(still)} breach(es) that held on {len(done)} seeds to {args.escalate_seeds} more ...",
              flush=True)
        rows = run_confirmation(still, rows, args, cluster, pool, first, done, args.escalate_seeds)
        annotate(violations, rows)


def run_confirmation(violations: list[dict], rows: list[dict], args: argparse.Namespace, cluster: SimConfig,
                     pool: ProcessPoolExecutor, first: tuple[int, ...], done: tuple[int, ...], count: int) -> list[dict]:
    """`count` more seeds after `done` for every point in `violations` (all three policies), plus
    the control on the sweep's own seeds the first time."""
    extra = tuple(range(done[-1] + 1, done[-1] + 1 + count))
    todo = []
    for trace, rate, cv in dict.fromkeys((v["trace"], v["rate"], v["cv"]) for v in violations):
        dataset = next(t.dataset for t in TRACES if t.name == trace)
        spec = WorkloadSpec(dataset, num_requests=args.requests, rate=rate, cv=cv, seed=args.seed)
        if count > 0:
            todo.append(("confirm", trace, spec, ("corral", "infaas++", CONTROL), cluster, extra))
        if done == first:
            todo.append(("confirm", trace, spec, (CONTROL,), cluster, first))
    return rows + [row for result in pool.map(run_point, todo) for row in result]


def cost_saving_at_similar_p99(rows: list[dict]) -> str:
    """Corral's cost against the cheapest INFaaS++ band whose P99 e2e is at most 10 % above
    Corral's at the same band settings or any other: the paper's cost-at-similar-P99 comparison."""
    scaled = [r for r in rows if r["section"] != "autoscale fixed 16"]
    points = {
        name: [(r["average_instances"], r["overall"]["e2e"]["p99_s"]) for r in scaled if r["policy"] == name]
        for name in ("corral", "infaas++")
    }
    best = None
    for cost, p99 in points["corral"]:
        rivals = [c for c, p in points["infaas++"] if p <= 1.10 * p99]
        if rivals:
            change = cost / min(rivals) - 1
            best = change if best is None else min(best, change)
    if best is None:
        return "no INFaaS++ band reaches Corral's P99 (Corral is better at every band)"
    return f"{best:+.0%} instances"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="requests per load point (paper: 10000)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, default=2,
                        help="workloads per load point (seeds --seed, --seed+1, ...); metrics are averaged: "
                        "near the knee one seed's P99 swings by several x")
    parser.add_argument("--only", help="comma list of trace names, 'priorities', 'autoscale'")
    parser.add_argument("--quick", action="store_true", help="the middle rate of each trace only")
    parser.add_argument("--step-mode", choices=("v0", "v1"), default="v0",
                        help="v0: the paper's testbed (default); v1: vLLM v1 mixed steps (rates stay the v0 ones)")
    parser.add_argument("--confirm-seeds", type=int, default=6,
                        help="re-run each point that breaks the 10 %% rule on this many more seeds, with the "
                        "control (INFaaS++ against itself); 0: no confirmation")
    parser.add_argument("--escalate-seeds", type=int, default=24,
                        help="a breach that still holds after --confirm-seeds is re-run on this many more seeds "
                        "(0: no escalation); the verdict is on all its seeds")
    parser.add_argument("--out", default="results/paper_repro.json", help="(results/ is git-ignored)")
    args = parser.parse_args()

    started = time.perf_counter()
    cluster = PAPER_CLUSTER.with_scheduler(step_mode=args.step_mode)
    todo = jobs(args, cluster)
    print(f"{len(todo)} load points × their policies × {args.seeds} seed(s), {args.requests} requests each, "
          f"{args.jobs} worker(s)", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        all_rows = [row for rows in pool.map(run_point, todo) for row in rows]
        summary = report(all_rows)
        if summary["violations"] and args.confirm_seeds > 0:
            print(f"\nconfirming {len(summary['violations'])} breach(es) on {args.confirm_seeds} more seeds ...", flush=True)
            confirm_breaches(summary["violations"], all_rows, args, cluster, pool)
    headline(summary, all_rows)
    elapsed = time.perf_counter() - started
    document = {
        "settings": {"requests": args.requests, "seeds": list(range(args.seed, args.seed + args.seeds)),
                     "cluster": asdict(cluster), "elapsed_s": elapsed},
        "summary": summary,
        "runs": all_rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(document, handle, indent=1, default=str)
    print(f"\n{len(all_rows)} runs in {elapsed / 60:.1f} min; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
