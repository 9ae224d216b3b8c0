"""Llumnix's metrics of a simulated run: prefill latency (TTFT), decode latency (mean time per
output token after the first, per request), end-to-end latency, preemption loss (extra queueing
and recompute time caused by preemptions, averaged over all requests); each mean and P99, for
all requests and per priority class; plus migrations and instance cost."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from loadgen.simulator.cluster import SimResult
from shared.engine_model.request import SimRequest
from shared.policy.config import HIGH_PRIORITY

CLASS_NAMES = {HIGH_PRIORITY: "high"}


@dataclass(frozen=True)
class LatencyStats:
    mean_s: float
    p50_s: float
    p99_s: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not len(values):
            return cls(0.0, 0.0, 0.0, 0)
        array = np.asarray(values, dtype=float)
        p50, p99 = np.percentile(array, (50, 99))
        return cls(float(array.mean()), float(p50), float(p99), len(values))


@dataclass(frozen=True)
class RequestLatencies:
    """Per-request values, in the order of `requests` (decode only for outputs > 1 token)."""

    prefill_s: list[float]
    decode_s: list[float]
    e2e_s: list[float]
    preemption_loss_s: list[float]

    @classmethod
    def of(cls, requests: Sequence[SimRequest]) -> RequestLatencies:
        prefill, decode, e2e, loss = [], [], [], []
        for r in requests:
            assert r.first_token_time is not None and r.finished_time is not None, r.request_id
            prefill.append(r.first_token_time - r.arrival_time)
            e2e.append(r.finished_time - r.arrival_time)
            loss.append(r.preemption_loss_s)
            if r.num_output_tokens > 1:
                decode.append((r.finished_time - r.first_token_time) / (r.num_output_tokens - 1))
        return cls(prefill, decode, e2e, loss)


@dataclass(frozen=True)
class ClassMetrics:
    count: int
    prefill: LatencyStats
    decode: LatencyStats
    e2e: LatencyStats
    preemption_loss_mean_s: float
    num_preempted: int  # requests preempted at least once

    @classmethod
    def of(cls, requests: Sequence[SimRequest]) -> ClassMetrics:
        values = RequestLatencies.of(requests)
        loss = values.preemption_loss_s
        return cls(
            count=len(requests),
            prefill=LatencyStats.of(values.prefill_s),
            decode=LatencyStats.of(values.decode_s),
            e2e=LatencyStats.of(values.e2e_s),
            preemption_loss_mean_s=float(np.mean(loss)) if loss else 0.0,
            num_preempted=sum(r.num_preemptions > 0 for r in requests),
        )


@dataclass(frozen=True)
class RunMetrics:
    policy: str
    workload: str
    num_requests: int
    completed: int
    rejected: int
    overall: ClassMetrics
    by_class: dict[str, ClassMetrics]  # "high" / "normal", by the workload's labels
    num_preemptions: int
    migrations: dict
    instance_hours: float
    average_instances: float
    makespan_s: float
    output_tokens: int
    wall_s: float

    def to_json(self) -> dict:
        return asdict(self)


def summarize(result: SimResult, block_bytes: int) -> RunMetrics:
    requests = result.finished
    classes: dict[str, list[SimRequest]] = {}
    for r in requests:
        classes.setdefault(CLASS_NAMES.get(result.labels[r.request_id], "normal"), []).append(r)
    migrations = result.migrations.to_json()
    migrations["copied_gib"] = round(result.migrations.copied_blocks * block_bytes / 2**30, 2)
    migrations["cached_gib"] = round(result.migrations.cached_blocks * block_bytes / 2**30, 2)  # not copied
    makespan = result.makespan_s
    return RunMetrics(
        policy=result.policy,
        workload=result.workload,
        num_requests=result.num_requests,
        completed=len(requests),
        rejected=len(result.rejected),
        overall=ClassMetrics.of(requests),
        by_class={name: ClassMetrics.of(members) for name, members in sorted(classes.items())},
        num_preemptions=result.num_preemptions,
        migrations=migrations,
        instance_hours=result.instance_seconds / 3600.0,
        average_instances=result.instance_seconds / makespan if makespan > 0 else 0.0,
        makespan_s=makespan,
        output_tokens=sum(r.num_output_tokens for r in requests),
        wall_s=result.wall_s,
    )
