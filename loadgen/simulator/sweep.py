"""Run several policies over one or more load points: the same workload (same seed) for every
policy at a load point, so differences come from the policies alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.metrics import RequestLatencies, summarize
from loadgen.simulator.report import RunRecord
from loadgen.simulator.workload import Workload, WorkloadSpec, build_workload
from shared.policy.baselines import SchedulingPolicy


def run_one(config: SimConfig, policy: SchedulingPolicy, spec: WorkloadSpec) -> RunRecord:
    workload = build_workload(spec, config.max_seq_len)
    return _record(config, policy, workload, spec.rate)


def run_sweep(
    config: SimConfig,
    policies: Sequence[SchedulingPolicy],
    spec: WorkloadSpec,
    rates: Sequence[float | None],
    on_record: Callable[[RunRecord], None] | None = None,
    on_workload: Callable[[Workload], None] | None = None,
) -> list[RunRecord]:
    records = []
    for rate in rates:
        point = spec if rate is None else spec.with_rate(rate)
        workload = build_workload(point, config.max_seq_len)
        if on_workload is not None:
            on_workload(workload)
        for policy in policies:
            record = _record(config, policy, workload, point.rate)
            records.append(record)
            if on_record is not None:
                on_record(record)
    return records


def _record(config: SimConfig, policy: SchedulingPolicy, workload, rate: float | None) -> RunRecord:
    result = ClusterSimulator(config, policy, workload).run()
    metrics = summarize(result, config.block_bytes)
    return RunRecord(rate, metrics, RequestLatencies.of(result.finished), result)
