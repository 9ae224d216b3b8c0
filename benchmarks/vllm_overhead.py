"""Corral's serving overhead against vLLM's own OpenAI server: same model, same engine settings,
same request set, one machine, one run.

    .venv/bin/python -m benchmarks.vllm_overhead [--rounds 2] [--light-rate 2] [--light-requests 40]
        [--rate 20] [--rate-requests 200] [--saturate-requests 256] [--saturate-concurrency 64]
        [--input-len 256] [--output-len 128] [--kv-cache-gib 1] [--max-num-seqs 128]
        [--max-model-len 2048] [--seed 0] [--systems corral,vllm[,corral-unplaced]] [--llumlet-env KEY=VALUE]
        [--out results/vllm_overhead.json] [--log-dir DIR]

Corral is gateway + global scheduler + one vLLM llumlet on an embedded NATS server; the reference
is `python -m vllm.entrypoints.openai.api_server`. Each is laid out on the cores its own way: vLLM's
server binds its worker to a core and reserves the rest for its front end; Corral's processes get
the layout `corral up` gives them (the llumlet on cores of its own, NATS, scheduler and gateway on
the rest); `--systems corral-unplaced` is Corral with no layout (`--cpu-layout off`). All get the
same KV cache size (in bytes, so VLLM_CPU_KVCACHE_SPACE is removed from every environment),
max_num_seqs, max_num_batched_tokens and max_model_len. Each round starts each system fresh, in
the order the systems are given (A, B, A, B, ...), warms it up, then runs three scenarios with the
same seed: Poisson arrivals at a light rate (small batches, so per-token overhead is visible),
Poisson at --rate, and a saturating run (--saturate-requests with at most --saturate-concurrency
in flight). Requests go to /v1/completions as text, streamed, with ignore_eos, so every request
yields --output-len tokens.

Per system and scenario the records of all rounds are pooled (throughput = completions / summed
durations; latency percentiles over all requests). Besides latency, the CPU seconds each process
used during the measured runs are recorded: on a 2-core machine they show where overhead goes.
ITL is vLLM's definition (gaps between streamed chunks): on a loaded machine chunks bunch up at
the client, so TPOT (per request) is the steadier measure of decode speed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from loadgen.client import EndpointConfig
from loadgen.metrics import BenchmarkMetrics, compute_metrics
from loadgen.records import RequestRecord
from loadgen.report import metrics_fields
from loadgen.runner import BenchmarkConfig, run_benchmark
from loadgen.schedule import SchedulePlan
from services.cpu_layout import available_cpus, cpu_layout_decision
from benchmarks.overhead_systems import REPO, GIB, Settings, System, make_system, SYSTEMS


PERCENTILES = (50.0, 90.0, 99.0)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# CPU accounting
# --------------------------------------------------------------------------------------------


def cpu_times(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, proc in procs.items():
        try:
            times = proc.cpu_times()
            out[name] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 3) for name in before if name in after}


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    num_requests: int
    rate: float  # requests/s; inf: all at once (bounded by max_concurrency)
    max_concurrency: int | None


@dataclass
class RunResult:
    system: str
    scenario: str
    round: int
    records: list[RequestRecord]
    duration_s: float
    metrics: BenchmarkMetrics
    cpu_s: dict[str, float]
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]


@dataclass
class Bench:
    settings: Settings
    input_len: int
    output_len: int
    seed: int
    runs: list[RunResult] = field(default_factory=list)

    def config(self, system: System, scenario: Scenario, label: str) -> BenchmarkConfig:
        endpoint = EndpointConfig(base_url=system.base_url, model=self.settings.model_name, api="completions",
                                  ignore_eos=True, request_timeout_s=600.0)
        arrival = "burst" if scenario.rate == float("inf") else "poisson"
        return BenchmarkConfig(
            endpoint=endpoint,
            dataset=f"random:{self.input_len}:{self.output_len}",
            plan=SchedulePlan(arrival=arrival, rate=scenario.rate, seed=self.seed),
            tokenizer=str(self.settings.model_dir),
            num_requests=scenario.num_requests,
            max_concurrency=scenario.max_concurrency,
            percentiles=PERCENTILES,
            label=label,
        )

    def measure(self, system: System, scenario: Scenario, round_index: int) -> RunResult:
        config = self.config(system, scenario, f"{system.name}-{scenario.name}-r{round_index}")
        procs = system.processes()
        load_before = os.getloadavg()
        before = cpu_times(procs)
        result = asyncio.run(run_benchmark(config))
        used = cpu_used(before, cpu_times(procs))
        run = RunResult(system.name, scenario.name, round_index, result.records, result.metrics.duration_s,
                        result.metrics, used, load_before, os.getloadavg())
        self.runs.append(run)
        return run

    def warm_up(self, system: System) -> None:
        warm = Scenario("warmup", num_requests=16, rate=float("inf"), max_concurrency=8)
        config = self.config(system, warm, f"{system.name}-warmup")
        config = dataclasses.replace(config, plan=SchedulePlan(seed=self.seed + 1000))
        metrics = asyncio.run(run_benchmark(config)).metrics
        if metrics.completed != warm.num_requests:
            raise RuntimeError(f"{system.name}: warm-up failed: {metrics.errors}")


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def pooled(runs: Sequence[RunResult]) -> BenchmarkMetrics:
    records = [r for run in runs for r in run.records]
    return compute_metrics(records, sum(run.duration_s for run in runs), PERCENTILES)


BACK_TO_BACK_S = 0.0005  # chunks this close arrived in one burst, not one engine step apart


def back_to_back_fraction(runs: Sequence[RunResult]) -> float:
    """Share of chunk gaps under 0.5 ms: how bunched a system's stream reaches the client.

    A median ITL near zero says more about this than about per-token cost: a server whose
    output is delivered in bursts scores a tiny P50 while its users see text arrive in lumps.
    """
    gaps = [b - a for run in runs for r in run.records for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    return sum(g < BACK_TO_BACK_S for g in gaps) / len(gaps) if gaps else 0.0


def summary_row(runs: Sequence[RunResult]) -> dict[str, float]:
    m = pooled(runs)
    return {
        "completed": m.completed,
        "failed": m.failed,
        "req_per_s": m.request_throughput,
        "out_tok_per_s": m.output_throughput,
        "ttft_p50_ms": m.ttft.median_ms,
        "ttft_p99_ms": m.ttft.percentiles_ms[99.0],
        "itl_p50_ms": m.itl.median_ms,
        "itl_p99_ms": m.itl.percentiles_ms[99.0],
        "tpot_p50_ms": m.tpot.median_ms,
        "tpot_p99_ms": m.tpot.percentiles_ms[99.0],
        "tpot_mean_ms": m.tpot.mean_ms,
        "e2el_p50_ms": m.e2el.median_ms,
        "itl_samples": m.itl.count,
        "itl_back_to_back_fraction": back_to_back_fraction(runs),
    }


def compare(corral: dict[str, float], vllm: dict[str, float]) -> dict[str, float]:
    out = {
        "throughput_ratio": corral["out_tok_per_s"] / vllm["out_tok_per_s"],
        "req_throughput_ratio": corral["req_per_s"] / vllm["req_per_s"],
    }
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tpot_mean_ms"):
        out[f"added_{key}"] = corral[key] - vllm[key]
    return out


def cpu_per_token(runs: Sequence[RunResult]) -> dict[str, float]:
    """Milliseconds of CPU per output token, per process role, summed over the runs."""
    tokens = sum(run.metrics.total_output_tokens for run in runs)
    totals: dict[str, float] = {}
    for run in runs:
        for name, seconds in run.cpu_s.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {name: round(1000 * s / tokens, 4) for name, s in sorted(totals.items())} if tokens else {}


def format_table(summaries: dict[str, dict[str, dict[str, float]]], comparisons: dict[str, dict[str, float]]) -> str:
    columns = [("req/s", "req_per_s", "{:.2f}"), ("out tok/s", "out_tok_per_s", "{:.0f}"),
               ("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
               ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}"),
               ("TPOT p50", "tpot_p50_ms", "{:.2f}"), ("TPOT p99", "tpot_p99_ms", "{:.2f}"),
               ("ITL<0.5ms", "itl_back_to_back_fraction", "{:.2f}"), ("done", "completed", "{:.0f}")]
    head = f"{'scenario':<10} {'system':<15} " + " ".join(f"{c[0]:>10}" for c in columns)
    lines = [head, "-" * len(head)]
    for scenario, by_system in summaries.items():
        for system, row in by_system.items():
            cells = " ".join(f"{fmt.format(row[key]):>10}" for _, key, fmt in columns)
            lines.append(f"{scenario:<10} {system:<15} {cells}")
        cmp = comparisons.get(scenario)
        if cmp:
            lines.append(
                f"{'':<10} {'Δ':<15} {'':>10} {cmp['throughput_ratio']:>10.3f} "
                f"{cmp['added_ttft_p50_ms']:>+10.1f} {cmp['added_ttft_p99_ms']:>+10.1f} "
                f"{cmp['added_itl_p50_ms']:>+10.2f} {cmp['added_itl_p99_ms']:>+10.2f} "
                f"{cmp['added_tpot_p50_ms']:>+10.2f} {cmp['added_tpot_p99_ms']:>+10.2f}"
            )
    lines.append("Δ row: out tok/s column = Corral/vLLM throughput ratio; the others = Corral − vLLM in ms")
    lines.append("ITL<0.5ms: share of chunk gaps under 0.5 ms (chunks that reached the client in one burst)")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    import vllm

    return {
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "cpu_model": _cpu_model(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "vllm": vllm.__version__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the generated tiny model)")
    parser.add_argument("--systems", default="corral,vllm", help="order within each round (default corral,vllm)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--light-rate", type=float, default=2.0,
                        help="light-load Poisson scenario (small batches: the per-token overhead shows)")
    parser.add_argument("--light-requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=20.0, help="Poisson scenario's request rate")
    parser.add_argument("--rate-requests", type=int, default=200)
    parser.add_argument("--saturate-requests", type=int, default=256)
    parser.add_argument("--saturate-concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="vLLM's CPU default, which Corral's llumlet keeps; passed to vLLM's server")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llumlet-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for Corral's llumlet only (experiments), repeatable")
    parser.add_argument("--ready-timeout-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "vllm_overhead.json")
    parser.add_argument("--log-dir", type=Path, help="process logs (default: next to --out)")
    args = parser.parse_args(argv)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if not systems or any(s not in SYSTEMS for s in systems):
        parser.error(f"--systems must name some of {', '.join(SYSTEMS)}")
    args.systems = systems
    try:
        args.llumlet_env = dict(item.split("=", 1) for item in args.llumlet_env)
    except ValueError:
        parser.error("--llumlet-env takes KEY=VALUE")
    for name in ("rounds", "light_requests", "rate_requests", "saturate_requests", "saturate_concurrency",
                 "input_len", "output_len", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if not args.rate > 0 or not args.light_rate > 0 or not args.kv_cache_gib > 0:
        parser.error("--rate, --light-rate and --kv-cache-gib must be positive")
    if args.input_len + args.output_len > args.max_model_len:
        parser.error("--input-len + --output-len must fit in --max-model-len")
    return args


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`: the servers started are stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # The servers run in their own sessions (a Ctrl-C in the terminal does not reach them), so a
    # plain SIGTERM to this process would leave them running.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from services.tools.make_model import ensure_tiny_model

    model_dir = (args.model or ensure_tiny_model()).resolve()
    settings = Settings(model_dir, model_dir.name, args.max_model_len, int(args.kv_cache_gib * GIB), args.max_num_seqs,
                        args.max_num_batched_tokens, args.llumlet_env)
    log_dir = args.log_dir or args.out.with_suffix("").with_name(args.out.stem + "_logs")
    shutil.rmtree(log_dir, ignore_errors=True)
    scenarios = [
        Scenario("light", args.light_requests, args.light_rate, None),
        Scenario("rate", args.rate_requests, args.rate, None),
        Scenario("saturate", args.saturate_requests, float("inf"), args.saturate_concurrency),
    ]
    bench = Bench(settings, args.input_len, args.output_len, args.seed)
    layout_reason = cpu_layout_decision("auto", "vllm", 1, False, available_cpus()).reason
    print(f"corral: {layout_reason}", flush=True)
    started = time.time()
    startup_s: dict[str, list[float]] = {s: [] for s in args.systems}
    for round_index in range(args.rounds):
        for name in args.systems:
            run_dir = log_dir / f"r{round_index}-{name}"
            run_dir.mkdir(parents=True, exist_ok=True)
            system = make_system(name, settings, run_dir)
            try:
                system.start()
                startup_s[name].append(round(system.wait_ready(args.ready_timeout_s), 1))
                bench.warm_up(system)
                for scenario in scenarios:
                    run = bench.measure(system, scenario, round_index)
                    m = run.metrics
                    print(f"[round {round_index}] {name:<15} {scenario.name:<8} {m.output_throughput:7.0f} tok/s  "
                          f"TTFT p50 {m.ttft.median_ms:7.1f} ms  ITL p50 {m.itl.median_ms:5.2f} ms  "
                          f"TPOT p50 {m.tpot.median_ms:5.2f} ms  done {m.completed}/{scenario.num_requests}  "
                          f"load {run.loadavg_before[0]:.2f}", flush=True)
            finally:
                system.stop()

    summaries: dict[str, dict[str, dict[str, float]]] = {}
    comparisons: dict[str, dict[str, float]] = {}
    for scenario in scenarios:
        by_system = {s: [r for r in bench.runs if r.system == s and r.scenario == scenario.name] for s in args.systems}
        summaries[scenario.name] = {s: summary_row(runs) for s, runs in by_system.items()}
        if {"corral", "vllm"} <= set(args.systems):
            comparisons[scenario.name] = compare(summaries[scenario.name]["corral"], summaries[scenario.name]["vllm"])
    print()
    print(format_table(summaries, comparisons))
    cpu = {f"{s}/{sc.name}": cpu_per_token([r for r in bench.runs if r.system == s and r.scenario == sc.name])
           for s in args.systems for sc in scenarios}
    print("\nCPU ms per output token, by process:")
    for key, by_proc in cpu.items():
        parts = "  ".join(f"{k}={v:.3f}" for k, v in by_proc.items())
        print(f"  {key:<16} total {sum(by_proc.values()):6.3f}  {parts}")

    out = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.vllm_overhead", *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": machine(),
        "settings": {**{k: v if isinstance(v, (int, dict)) else str(v) for k, v in settings.__dict__.items()},
                     "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                     "rounds": args.rounds, "order": list(args.systems), "corral_cpu_layout": layout_reason},
        "scenarios": [{**sc.__dict__, "rate": sc.rate if sc.rate != float("inf") else "inf"} for sc in scenarios],
        "startup_s": startup_s,
        "summary": summaries,
        "comparison": comparisons,
        "cpu_ms_per_output_token": cpu,
        "runs": [
            {"system": r.system, "scenario": r.scenario, "round": r.round, "cpu_s": r.cpu_s,
             "loadavg_before": r.loadavg_before, "loadavg_after": r.loadavg_after, **metrics_fields(r.metrics)}
            for r in bench.runs
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nresult written to {args.out}; logs in {log_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
