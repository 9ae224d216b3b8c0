"""Speed of the simulated engine's scheduler core alone: N requests over K instances, round-robin,
in virtual time (no sleeps), step times from the latency model.

    .venv/bin/python -m benchmarks.sim_core_speed [--requests 10000] [--instances 16] [--rate 16]
        [--trace ../shared/data/traces/sharegpt_val_10k_llama2.csv] [--step-mode v1] [--profile]

Lengths come from a CSV (vidur format: num_prefill_tokens,num_decode_tokens, or the Azure trace:
ContextTokens,GeneratedTokens); the default is the ShareGPT lengths from the team handouts, and
--synthetic (or no trace file) uses a seeded log-normal mix. Prints wall time and what was simulated.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import pstats
import random
import time
from pathlib import Path

from shared.engine_model.config import SchedulerConfig
from shared.engine_model.latency import LatencyModel
from shared.engine_model.request import SimRequest
from shared.engine_model.scheduler import SimScheduler

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/sharegpt_val_10k_llama2.csv"


def load_lengths(trace: Path | None, count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    if trace is not None:
        with trace.open() as f:
            reader = csv.DictReader(f)
            azure = "ContextTokens" in (reader.fieldnames or ())
            columns = ("ContextTokens", "GeneratedTokens") if azure else ("num_prefill_tokens", "num_decode_tokens")
            rows = [(int(r[columns[0]]), int(r[columns[1]])) for r in reader]
        return [rows[i % len(rows)] for i in range(count)]
    def draw(mu: float, cap: int) -> int:
        return min(cap, max(1, int(rng.lognormvariate(mu, 1.0))))

    return [(draw(5.5, 4000), draw(5.0, 2000)) for _ in range(count)]


def run_instance(
    scheduler: SimScheduler, latency: LatencyModel, arrivals: list[tuple[float, SimRequest]]
) -> tuple[int, float]:
    """Drive one instance until all its requests finish; returns (steps, virtual end time)."""
    now, steps, index = 0.0, 0, 0
    while index < len(arrivals) or scheduler.has_work():
        while index < len(arrivals) and arrivals[index][0] <= now:
            scheduler.add_request(arrivals[index][1])
            index += 1
        if not scheduler.has_work():
            now = arrivals[index][0]
            continue
        out = scheduler.schedule(now)
        assert not out.is_empty or out.preempted, "an instance with work scheduled nothing"
        now += latency.step_time_of(out)
        scheduler.update_from_output(out, now)
        steps += 1
    return steps, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--rate", type=float, default=16.0, help="cluster arrival rate, requests/s (Poisson)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE if DEFAULT_TRACE.exists() else None)
    parser.add_argument("--synthetic", action="store_true", help="ignore --trace, use log-normal lengths")
    parser.add_argument("--step-mode", default="v1", choices=("v1", "v0"))
    parser.add_argument("--queue-policy", default="fcfs", choices=("fcfs", "priority", "sjf"))
    parser.add_argument("--gpu", default="A10")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    lengths = load_lengths(None if args.synthetic else args.trace, args.requests, args.seed)
    rng = random.Random(args.seed)
    config = SchedulerConfig(step_mode=args.step_mode, queue_policy=args.queue_policy)
    schedulers = [SimScheduler(config) for _ in range(args.instances)]
    per_instance: list[list[tuple[float, SimRequest]]] = [[] for _ in schedulers]
    requests, t = [], 0.0
    for i, (prompt, output) in enumerate(lengths):
        t += rng.expovariate(args.rate)
        prompt = min(prompt, config.max_model_len - 1)
        priority = rng.choice((0, 0, 0, -1))  # a quarter high priority
        request = SimRequest(f"r{i}", prompt, max_tokens=max(1, output), priority=priority, arrival_time=t)
        requests.append(request)
        per_instance[i % args.instances].append((t, request))
    latency = LatencyModel(args.gpu)

    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    results = [run_instance(s, latency, arrivals) for s, arrivals in zip(schedulers, per_instance)]
    wall = time.perf_counter() - start
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)

    steps = sum(r[0] for r in results)
    tokens = sum(r.num_output_tokens for r in requests)
    max_seq_len = schedulers[0].max_seq_len
    assert all(r.is_finished and r.num_output_tokens == min(r.max_tokens, max_seq_len - r.prompt_len) for r in requests)
    preemptions = sum(s.num_preemptions_total for s in schedulers)
    latencies = sorted(r.finished_time - r.arrival_time for r in requests)
    source = "synthetic" if args.synthetic or args.trace is None else args.trace.name
    print(
        f"{args.requests} requests ({source}), {args.instances} instances, {args.step_mode}/{args.queue_policy}: "
        f"wall {wall:.2f} s; {steps} steps, {tokens} output tokens, {preemptions} preemptions; "
        f"virtual span {max(r[1] for r in results):.0f} s, latency p50 {latencies[len(latencies) // 2]:.1f} s "
        f"p99 {latencies[int(len(latencies) * 0.99)]:.1f} s"
    )


if __name__ == "__main__":
    main()
