"""Small clusters and hand-made workloads for the simulator tests."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest

from loadgen.simulator.cluster import ClusterSimulator, SimResult
from loadgen.simulator.config import SimConfig
from loadgen.simulator.workload import SimArrival, Workload, WorkloadSpec, build_workload
from shared.engine_model.config import SchedulerConfig
from shared.policy.baselines import get_policy

SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}
TRACES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"

SMALL = SimConfig(num_instances=4, scheduler=SchedulerConfig(num_blocks=200, max_model_len=3200, step_mode="v0"))


def workload_of(rows: list[tuple[float, int, int, int]]) -> Workload:
    """(arrival time, prompt tokens, output tokens, priority) per request, in time order."""
    arrivals = [SimArrival(i, t, prompt, output, priority) for i, (t, prompt, output, priority) in enumerate(rows)]
    return Workload(arrivals, "hand-made")


def synthetic(dataset: str, n: int, rate: float, config: SimConfig = SMALL, **kwargs) -> Workload:
    return build_workload(WorkloadSpec(dataset, num_requests=n, rate=rate, **kwargs), config.max_seq_len)


def simulate(config: SimConfig, policy: str, workload: Workload, **kwargs) -> SimResult:
    return ClusterSimulator(config, get_policy(policy), workload, **kwargs).run()


def small(**changes) -> SimConfig:
    """SMALL with these changes; local-scheduler settings (num_blocks=...) go to its scheduler."""
    engine = {name: changes.pop(name) for name in list(changes) if name in SCHEDULER_FIELDS}
    return replace(SMALL.with_scheduler(**engine), **changes)


def trace_path(name: str) -> Path:
    path = TRACES_DIR / name
    if not path.is_file():
        pytest.skip(f"trace {path} is absent (the ../shared handouts are not checked out)")
    return path
