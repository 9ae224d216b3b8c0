"""Admission control under overload (issue 19 §1): none / current-load / predicted, side by side.

    .venv/bin/python -m benchmarks.admission [--dataset synthetic:sharegpt] [--instances 4] [--requests 800] [--seeds 0,1]
        [--overloads 1.5,2] [--slo-ttft-s 3] [--slo-tbt-s 0.08] [--prefill N --decode M]
        [--gpu A10] [--num-blocks N] [--dispatch corral] [--prefix-caching] [--trace-timestamps]
        [--system-prompts K] [--out results/admission.json]

e.g. P/D on a prefill-heavy trace: --dataset synthetic:L-S --instances 8 --prefill 5 --decode 3 --slo-ttft-s 2
--slo-tbt-s 0.1 --requests 600 (the issue-19 closing note's tables: colocated ShareGPT-like and L-S at TBT 50 ms,
300 requests; P/D L-S 5:3, L-M 4:4 and ShareGPT-like 4:4, 600 requests; seeds 0,1,2).

LLaMA-7B on A10 instances (the simulator's defaults; `--gpu`, `--num-blocks`), `--dataset` lengths
(ShareGPT-like by default), 10 % high priority, corral dispatch (`--dispatch NAME`); the same requests
for every admission policy. Prefixes: `--prefix-caching` with a `conversation:...` dataset at its
own timing (`--trace-timestamps`: a turn finds the one before it cached), `--system-prompts K` for
shared system prompts; admission predicts only what an instance does not hold cached. With `--prefill N --decode M`
the first N instances prefill only and the next M decode only (P/D disaggregation, hand-off at the
first token; admission then forecasts the decode pool: `shared.policy.decode_pool`). The saturating rate is
measured first: the highest rate at which the cluster admitting everything keeps P99 TTFT within
the SLO. Two workloads per seed:
- overload replay: Poisson arrivals at each `--overloads` multiple of the saturating rate;
- square-wave burst: half a period at 2x the saturating rate, half at 0.5x, repeated; the period is
  20 s, or a third of the workload's span when that is shorter (at least three bursts).

Per run: goodput (requests meeting both SLOs per second of the arrival window), rejected share
(and of high priority), wasted prefill (prompt tokens of accepted requests that then missed the
SLO, over all prompt tokens prefilled), accepted P99 TTFT/TBT, the coefficient of variation
of accepted requests per second (oscillation shows as a high CV at a steady offered load), the
most an accepted request's TTFT exceeded the SLO by, and the TTFT prediction error (accepted
requests' TTFT less admission's prediction on their instance, P50 and P99: what an accepted
request's SLO miss is to be judged against). A
PNG per workload (seed 0) plots accepted and rejected per second for each policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.prefix_workloads import with_system_prompts
from loadgen.simulator.admission import AdmissionModel
from loadgen.simulator.cluster import ClusterSimulator, SimResult
from loadgen.simulator.config import SimConfig
from loadgen.simulator.slo import per_second, slo_metrics
from loadgen.simulator.workload import Workload, WorkloadSpec, build_workload
from shared.policy.admission import ADMISSION_POLICY_NAMES, AdmissionPolicy, Slo, SloConfig
from shared.policy.baselines import POLICIES, get_policy
from shared.policy.config import HIGH_PRIORITY

DEFAULT_DATASET = "synthetic:sharegpt"
SYSTEM_PROMPT_TOKENS = 2048  # `--system-prompts`' length (benchmarks/prefix_dispatch.py's default)
PERIOD_S = 20.0  # square wave: half at 2x saturation, half at 0.5x


def simulate(config: SimConfig, workload: Workload, policy: AdmissionPolicy, slo: SloConfig,
             dispatch: str = "corral") -> SimResult:
    """`dispatch`: the policy choosing among the admitted instances."""
    admitting = replace(config, admission=AdmissionModel(policy, slo))
    return ClusterSimulator(admitting, get_policy(dispatch), workload).run()


class TooSmallToSaturate(Exception):
    """The whole workload, arriving at once, keeps P99 TTFT within the SLO: no rate saturates it."""


def saturating_rate(config: SimConfig, workload_at: Callable[[float], Workload], slo: SloConfig,
                    dispatch: str = "corral") -> float:
    """The highest offered rate (steps of 0.25 req/s; past 8 req/s, of 1/32 of the rate: a run per
    step) at which the cluster, admitting everything, still keeps P99 TTFT within the SLO.
    TooSmallToSaturate where it keeps it even with every request arriving within a thousandth of
    the SLO (a higher rate would load it no more: the search would never end)."""
    rate = 0.25
    while True:
        step = 0.25 if rate < 8 else rate / 32
        workload = workload_at(rate + step)
        result = simulate(config, workload, AdmissionPolicy.NONE, slo, dispatch)
        p99 = slo_metrics(result, slo).accepted_ttft_p99_s
        if p99 > slo.default.ttft_s:
            return rate
        times = [arrival.time_s for arrival in workload.arrivals]
        if max(times) - min(times) < 1e-3 * slo.default.ttft_s:
            raise TooSmallToSaturate(f"{len(times)} requests arriving at once keep P99 TTFT at {p99:.2f} s, within "
                                     f"the {slo.default.ttft_s:g} s SLO: raise --requests or lower --slo-ttft-s")
        rate += step


def workload_of(spec: WorkloadSpec, config: SimConfig, system_prompts: int) -> Workload:
    """The spec's workload; with `system_prompts`, each session opening with one of that many
    shared system prompts (as benchmarks/prefix_dispatch.py's system-prompts workload)."""
    workload = build_workload(spec, config.max_seq_len)
    if not system_prompts:
        return workload
    return with_system_prompts(workload, system_prompts, SYSTEM_PROMPT_TOKENS, config.max_seq_len, spec.seed)


def square_wave(base: Workload, dataset: str, saturation: float, seed: int) -> Workload:
    period = min(PERIOD_S, len(base.arrivals) / (1.25 * saturation) / 3)  # the mean rate is 1.25x
    rng = np.random.default_rng(seed + 1)  # (not the Poisson workloads' draws)
    t, arrivals = 0.0, []
    for arrival in base.arrivals:
        rate = 2.0 * saturation if (t % period) < period / 2 else 0.5 * saturation
        t += rng.exponential(1.0 / rate)
        arrivals.append(replace(arrival, time_s=t))
    return Workload(arrivals, f"{dataset} square wave 2x/0.5x of {saturation:.2f} req/s, period {period:.3g} s")


def row(result: SimResult, slo: SloConfig) -> dict:
    m = slo_metrics(result, slo).to_json()
    accepted, rejected = per_second(result)
    last_arrival = int(max([r.arrival_time for r in result.finished] + [x.at_s for x in result.rejected]))
    steady = np.asarray(accepted[5:last_arrival], dtype=float)  # skip the warm-up seconds
    high = [rid for rid, p in result.labels.items() if p == HIGH_PRIORITY]
    high_rejected = sum(result.labels[x.request_id] == HIGH_PRIORITY for x in result.rejected)
    m["high_rejected_share"] = high_rejected / len(high) if high else 0.0
    m["accepted_per_s_cv"] = float(steady.std() / steady.mean()) if steady.size and steady.mean() > 0 else 0.0
    m["per_second"] = {"accepted": accepted[:last_arrival + 1], "rejected": rejected[:last_arrival + 1]}
    return m


def plot(runs: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadgen.plots import save_figure

    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 2.4 * len(runs)), sharex=True)
    for ax, (name, m) in zip(np.atleast_1d(axes), runs.items(), strict=True):
        series = m["per_second"]
        ax.plot(series["accepted"], label="accepted", color="tab:green")
        ax.plot(series["rejected"], label="rejected", color="tab:red")
        ax.set_ylabel("req/s")
        ax.set_title(f"{name}: goodput {m['goodput_rps']:.2f}/s, rejected {m['rejected_share']:.0%}", fontsize=9)
        ax.legend(loc="upper right", fontsize=8)
    np.atleast_1d(axes)[-1].set_xlabel("arrival second")
    figure.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(plt, figure, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--dataset", default=DEFAULT_DATASET, help="loadgen dataset SPEC (lengths)")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--overloads", default="1.5,2")
    parser.add_argument("--slo-ttft-s", type=float, default=3.0)
    parser.add_argument("--slo-tbt-s", type=float, default=0.08)
    parser.add_argument("--slo-reserve", type=float, default=SloConfig(Slo(1, 1)).reserve,
                        help="share of the SLO normal priority may not use (its margin for prediction error)")
    parser.add_argument("--slo-handoff-reserve", type=float, default=SloConfig(Slo(1, 1)).handoff_reserve,
                        help="the same on a prefill instance of P/D pools")
    parser.add_argument("--prefill", type=int, default=0, help="prefill-only instances (P/D; of --instances)")
    parser.add_argument("--decode", type=int, default=0, help="decode-only instances (P/D; of --instances)")
    parser.add_argument("--dispatch", default="corral", choices=sorted(POLICIES),
                        help="the dispatch policy among the admitted instances (corral-prefix: by prefix and queue)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="every instance caches prefixes (vLLM's prefix caching): a cached prefix is not "
                             "prefilled again, and admission predicts only the rest (try a conversation:... dataset)")
    parser.add_argument("--gpu", default="A10", choices=["A10", "A100", "H100"], help="latency profile")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per instance (default: the GPU's)")
    parser.add_argument("--system-prompts", type=int, default=0, metavar="K",
                        help="each session opens with one of K shared 2,048-token system prompts (Zipf-skewed; "
                             "as benchmarks/prefix_dispatch.py's system-prompts workload; 0: none)")
    parser.add_argument("--trace-timestamps", action="store_true",
                        help="arrivals at the dataset's own times rescaled to each rate (a conversation's turns "
                             "in their order and spacing, so a turn finds the one before it cached), not Poisson")
    parser.add_argument("--out", default="results/admission.json")
    args = parser.parse_args(argv)
    if args.num_blocks is not None and args.num_blocks < 1:
        parser.error(f"--num-blocks must be at least 1, got {args.num_blocks}")
    seeds = [int(s) for s in args.seeds.split(",")]
    overloads = [float(x) for x in args.overloads.split(",")]
    slo = SloConfig(Slo(args.slo_ttft_s, args.slo_tbt_s), reserve=args.slo_reserve,
                    handoff_reserve=args.slo_handoff_reserve)
    config = SimConfig(num_instances=args.instances, gpu=args.gpu, num_prefill=args.prefill, num_decode=args.decode)
    if args.prefix_caching:
        config = config.with_scheduler(enable_prefix_caching=True)
    if args.num_blocks is not None:
        config = config.with_scheduler(num_blocks=args.num_blocks)
    probe = WorkloadSpec(args.dataset, num_requests=args.requests, seed=seeds[0],
                         trace_timestamps=args.trace_timestamps)
    try:
        saturation = saturating_rate(config, lambda rate: workload_of(probe.with_rate(rate), config,
                                                                      args.system_prompts), slo, args.dispatch)
    except TooSmallToSaturate as error:
        parser.error(str(error))
    roles = f" (P/D {args.prefill}:{args.decode})" if config.disaggregated else ""
    caching = ", prefix caching" if args.prefix_caching else ""
    print(f"{args.instances} x {args.gpu}{roles}{caching}, {args.dataset}, {args.dispatch} dispatch, saturating rate "
          f"{saturation:.2f} req/s; "
          f"SLO TTFT {args.slo_ttft_s:g} s, TBT {args.slo_tbt_s * 1e3:g} ms (normal priority keeps "
          f"{slo.reserve:.0%} in reserve{f', {slo.handoff_reserve:.0%} on prefill instances' if config.disaggregated else ''})")
    header = (f"{'workload':<16} {'seed':>4} {'admission':<13} {'goodput':>9} {'rejected':>8} {'high rej':>8} "
              f"{'wasted pf':>9} {'P99 TTFT':>9} {'P99 TBT':>8} {'acc/s CV':>8} {'worst miss':>10} {'err P50':>8} "
              f"{'err P99':>8}")
    print(header)
    document = {"settings": {**vars(args), "saturating_rate": saturation, "dataset": args.dataset}, "runs": []}
    out = Path(args.out)
    for seed in seeds:
        spec = WorkloadSpec(args.dataset, num_requests=args.requests, priority_fraction=0.1, seed=seed,
                            trace_timestamps=args.trace_timestamps)
        workloads = {f"overload {x:g}x": workload_of(spec.with_rate(x * saturation), config, args.system_prompts)
                     for x in overloads}
        base = workload_of(spec.with_rate(saturation), config, args.system_prompts)
        workloads["square wave"] = square_wave(base, args.dataset, saturation, seed)
        for name, workload in workloads.items():
            runs = {}
            for policy in ADMISSION_POLICY_NAMES:
                result = simulate(config, workload, AdmissionPolicy(policy), slo, args.dispatch)
                m = runs[policy] = row(result, slo)
                print(f"{name:<16} {seed:>4} {policy:<13} {m['goodput_rps']:>7.2f}/s {m['rejected_share']:>8.1%} "
                      f"{m['high_rejected_share']:>8.1%} {m['wasted_prefill_share']:>9.1%} "
                      f"{m['accepted_ttft_p99_s']:>8.2f}s {m['accepted_tbt_p99_s'] * 1e3:>6.0f}ms "
                      f"{m['accepted_per_s_cv']:>8.2f} {max(m['worst_ttft_miss_s'], 0.0):>9.2f}s "
                      f"{m['ttft_prediction_error_p50_s']:>+7.2f}s {m['ttft_prediction_error_p99_s']:>+7.2f}s", flush=True)
                document["runs"].append({"workload": name, "seed": seed, "admission": policy, **m})
            if seed == seeds[0]:
                png = out.with_name(f"{out.stem}_{name.replace(' ', '_')}.png")  # (beside its JSON, by its name)
                plot(runs, f"{workload.description}; seed {seed}", png)
                print(f"plot: {png}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
