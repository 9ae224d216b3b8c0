"""Simulated workloads come from loadgen's datasets, arrival processes and priority flags."""

from __future__ import annotations

import pytest

from loadgen.arrivals import arrival_times
from loadgen.datasets import load_dataset
from loadgen.simulator.workload import WorkloadSpec, build_workload
from shared.policy.config import HIGH_PRIORITY
from tests.simulator.helpers import trace_path


def test_lengths_and_times_are_loadgens_own():
    workload = build_workload(WorkloadSpec("synthetic:S-L", num_requests=50, rate=4.0, seed=3), max_seq_len=8192)
    specs = load_dataset("synthetic:S-L", num_requests=50, seed=3)
    assert [(a.prompt_len, a.output_len) for a in workload.arrivals] == [(s.input_len, s.output_len) for s in specs]
    assert [a.time_s for a in workload.arrivals] == arrival_times("poisson", 50, rate=4.0, seed=3)


def test_priority_fraction_and_simultaneous_arrivals_high_first():
    workload = build_workload(WorkloadSpec("random:10:5", num_requests=40, rate=float("inf"), priority_fraction=0.25),
                              max_seq_len=8192)
    priorities = [a.priority for a in workload.arrivals]
    assert priorities.count(HIGH_PRIORITY) == 10
    assert priorities == sorted(priorities)  # all at t=0: high priority dispatched first


def test_prompts_too_long_for_an_instance_are_cut_and_counted():
    workload = build_workload(WorkloadSpec("random:5000:10", num_requests=3, rate=1.0), max_seq_len=4096)
    assert {a.prompt_len for a in workload.arrivals} == {4095}
    assert workload.num_truncated == 3 and "3 prompts cut to 4095 tokens" in workload.description


def test_trace_timestamps_keep_their_shape_rescaled_to_a_rate():
    path = trace_path("AzureLLMInferenceTrace_conv.csv")
    raw = build_workload(WorkloadSpec(f"azure:{path}", num_requests=200, trace_timestamps=True), max_seq_len=8192)
    scaled = build_workload(WorkloadSpec(f"azure:{path}", num_requests=200, trace_timestamps=True, rate=20.0),
                            max_seq_len=8192)
    assert scaled.arrivals[-1].time_s == pytest.approx(200 / 20.0)
    factor = scaled.arrivals[-1].time_s / raw.arrivals[-1].time_s
    assert [a.time_s for a in scaled.arrivals] == pytest.approx([a.time_s * factor for a in raw.arrivals])
