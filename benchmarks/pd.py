"""Prefill/decode disaggregation by live migration (issue 19 §2) against mixed instances.

    .venv/bin/python -m benchmarks.pd [--instances 8] [--requests 600] [--seeds 0,1] [--sweep-seed 100]
        [--workload NAME=SPEC@R1,R2 ...] [--slo-ttft-s 2] [--slo-tbt-s 0.1] [--bandwidth-gbps 15]
        [--out results/pd.json]

The simulator's defaults (LLaMA-7B on A10, vLLM v1-style steps: chunked prefill in a 2,048-token
budget shared with decodes); the same instance count for every system:
- P/D: `--prefill P --decode D` under corral (hand-off at the first token to the freest decode
  instance by the staged live migration, KV copied at `--bandwidth-gbps`), P:D chosen by a sweep
  of every split on `--sweep-seed`, a seed the comparison does not use;
- mixed corral; mixed infaas++.
Workloads (default): prefill-heavy `synthetic:L-S` (long prompts, short outputs) and
decode-heavy `synthetic:S-L`, Poisson at each listed rate.

Per run: P99 TTFT, P99 TBT (per request, the mean time per output token after the first, as
the simulator's decode latency), goodput (requests meeting both SLOs per second of the arrival
window), the share meeting the SLO, and for P/D the share handed off and the share that stayed
on its prefill instance for want of room, and the preemptions (memory pressure). The table
shows the mean over the seeds (min-max in the JSON); the closing lines say where P/D wins and
where it loses, from these numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loadgen.simulator.cluster import ClusterSimulator, SimResult
from loadgen.simulator.config import MigrationModel, SimConfig
from loadgen.simulator.slo import slo_metrics
from loadgen.simulator.workload import Workload, WorkloadSpec, build_workload
from shared.policy.admission import Slo, SloConfig
from shared.policy.baselines import get_policy

DEFAULT_WORKLOADS = ("prefill-heavy=synthetic:L-S@16,24", "decode-heavy=synthetic:S-L@10,18")
METRICS = ("ttft_p99_s", "tbt_p99_s", "goodput_rps", "met_share")


@dataclass(frozen=True)
class WorkloadArg:
    name: str
    dataset: str
    rates: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> WorkloadArg:
        try:
            name, rest = text.split("=", 1)
            dataset, rates = rest.rsplit("@", 1)
            parsed = tuple(float(r) for r in rates.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--workload {text!r}: expected NAME=SPEC@R1,R2") from None
        if not name or not dataset or not parsed or any(not r > 0 for r in parsed):
            raise argparse.ArgumentTypeError(f"--workload {text!r}: a name, a dataset and rates > 0")
        return cls(name, dataset, parsed)


@dataclass(frozen=True)
class System:
    name: str
    policy: str
    num_prefill: int = 0
    num_decode: int = 0


def measure(config: SimConfig, system: System, workload: Workload, slo: SloConfig) -> dict:
    config = replace(config, num_prefill=system.num_prefill, num_decode=system.num_decode)
    result: SimResult = ClusterSimulator(config, get_policy(system.policy), workload).run()
    m = slo_metrics(result, slo)
    row = {
        "ttft_p99_s": m.accepted_ttft_p99_s,
        "tbt_p99_s": m.accepted_tbt_p99_s,
        "goodput_rps": m.goodput_rps,
        "met_share": m.met_slo / m.num_requests,
        "completed": m.accepted,
        "preemptions": result.num_preemptions,  # memory pressure: where P/D loses, decode instances preempt
    }
    if result.handoffs is not None:
        h = result.handoffs
        row["handoffs"] = h.to_json()
        row["handed_off_share"] = h.committed / h.prefilled if h.prefilled else 0.0
        row["stayed_share"] = h.degraded / h.prefilled if h.prefilled else 0.0
    assert m.accepted == len(workload.arrivals), f"{system.name}: {m.accepted} of {len(workload.arrivals)} finished"
    return row


def splits(instances: int) -> list[System]:
    return [System(f"P/D {p}:{instances - p}", "corral", p, instances - p) for p in range(1, instances)]


def best_split(runs: dict[str, dict]) -> str:
    """Most goodput; ties (within 0.5 %) to the lower P99 TBT, then the lower P99 TTFT."""
    top = max(r["goodput_rps"] for r in runs.values())
    tied = [name for name, r in runs.items() if r["goodput_rps"] >= top * 0.995]
    return min(tied, key=lambda name: (runs[name]["tbt_p99_s"], runs[name]["ttft_p99_s"]))


def mean_row(rows: list[dict]) -> dict:
    out = {k: float(np.mean([r[k] for r in rows])) for k in METRICS}
    out.update({f"{k}_range": [float(min(r[k] for r in rows)), float(max(r[k] for r in rows))] for k in METRICS})
    out["preemptions"] = float(np.mean([r["preemptions"] for r in rows]))
    for key in ("handed_off_share", "stayed_share"):
        if key in rows[0]:
            out[key] = float(np.mean([r[key] for r in rows]))
    return out


def verdicts(pd: dict, mixed: dict, against: str) -> list[str]:
    """Where P/D wins and loses against one mixed system, metric by metric (5 % dead band)."""
    lines = []
    for key, label, higher_better in (("goodput_rps", "goodput", True), ("ttft_p99_s", "P99 TTFT", False),
                                      ("tbt_p99_s", "P99 TBT", False)):
        a, b = pd[key], mixed[key]
        if b == 0:
            continue
        change = (a - b) / b
        better = change > 0 if higher_better else change < 0
        if abs(change) < 0.05:
            lines.append(f"{label} even with {against} ({change:+.0%})")
        else:
            lines.append(f"{label} {'wins' if better else 'loses'} against {against} ({change:+.0%})")
    return lines


def fmt(name: str, r: dict) -> str:
    handed = (f"{r['handed_off_share']:>7.0%} {r['stayed_share']:>6.0%}" if "handed_off_share" in r
              else f"{'-':>7} {'-':>6}")
    return (f"{name:<12} {r['ttft_p99_s']:>8.2f}s {r['tbt_p99_s'] * 1e3:>7.0f}ms {r['goodput_rps']:>7.2f}/s "
            f"{r['met_share']:>6.1%} {r['preemptions']:>7.0f} {handed}")


HEADER = (f"{'system':<12} {'P99 TTFT':>9} {'P99 TBT':>9} {'goodput':>9} {'SLO met':>6} {'preempt':>7} "
          f"{'handed':>7} {'stayed':>6}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--seeds", default="0,1", help="seeds the comparison runs on")
    parser.add_argument("--sweep-seed", type=int, default=100, help="seed the P:D sweep picks the split on")
    parser.add_argument("--workload", action="append", type=WorkloadArg.parse, metavar="NAME=SPEC@R1,R2",
                        help=f"repeatable; default: {' '.join(DEFAULT_WORKLOADS)}")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-tbt-s", type=float, default=0.1)
    parser.add_argument("--bandwidth-gbps", type=float, default=MigrationModel().bandwidth_gbps,
                        help="KV copy bandwidth of the hand-off (and every migration), GB/s")
    parser.add_argument("--out", default="results/pd.json")
    args = parser.parse_args(argv)
    if args.instances < 2:
        parser.error("--instances must be at least 2 (one prefill and one decode)")
    workloads = args.workload or [WorkloadArg.parse(w) for w in DEFAULT_WORKLOADS]
    seeds = [int(s) for s in args.seeds.split(",")]
    slo = SloConfig(Slo(args.slo_ttft_s, args.slo_tbt_s))
    config = SimConfig(num_instances=args.instances, migration=MigrationModel(bandwidth_gbps=args.bandwidth_gbps))
    mixed = [System("corral", "corral"), System("infaas++", "infaas++")]
    print(f"{args.instances} x A10 (LLaMA-7B), up to {args.requests} requests a run; SLO TTFT {args.slo_ttft_s:g} s, "
          f"TBT {args.slo_tbt_s * 1e3:g} ms; KV hand-off at {args.bandwidth_gbps:g} GB/s; split swept on seed "
          f"{args.sweep_seed}, compared on seeds {args.seeds}")
    document: dict = {"settings": {**vars(args), "workload": [vars(w) for w in workloads]}, "points": []}
    summary = []
    for w in workloads:
        for rate in w.rates:
            spec = WorkloadSpec(w.dataset, num_requests=args.requests, rate=rate)
            sweep_load = build_workload(replace(spec, seed=args.sweep_seed), config.max_seq_len)
            sweep = {s.name: measure(config, s, sweep_load, slo) for s in splits(args.instances)}
            best = best_split(sweep)
            chosen = next(s for s in splits(args.instances) if s.name == best)
            print(f"\n{w.name} ({w.dataset}, {len(sweep_load.arrivals)} requests) at {rate:g} req/s — "
                  f"sweep on seed {args.sweep_seed}: " + ", ".join(f"{n.removeprefix('P/D ')} {r['goodput_rps']:.2f}/s" for n, r in sweep.items())
                  + f" -> {best}")
            per_seed: dict[str, list[dict]] = {s.name: [] for s in (chosen, *mixed)}
            for seed in seeds:
                load = build_workload(replace(spec, seed=seed), config.max_seq_len)
                for system in (chosen, *mixed):
                    per_seed[system.name].append(measure(config, system, load, slo))
            means = {name: mean_row(rows) for name, rows in per_seed.items()}
            print(HEADER)
            for name, row in means.items():
                print(fmt(name, row))
            lines = verdicts(means[best], means["corral"], "mixed corral") + verdicts(means[best], means["infaas++"],
                                                                                     "mixed infaas++")
            print(f"  {best}: " + "; ".join(lines))
            summary.append(f"{w.name} @ {rate:g}/s, {best}: " + "; ".join(lines))
            document["points"].append({"workload": w.name, "dataset": w.dataset, "rate": rate, "best_split": best,
                                       "sweep": sweep, "runs": per_seed, "mean": means, "verdicts": lines})
    print("\nwhere P/D wins and loses:\n  " + "\n  ".join(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
