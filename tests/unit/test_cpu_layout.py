"""Where `corral up` puts its processes: the layout rule, when it applies, and that the processes
it starts really keep to their cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.cpu_layout import (
    CpuLayout, cpu_layout_decision, format_cpus, keep_to, plan_cpu_layout, resolve_engine,
)
from services.process_helpers import child_setup
from shared.embedded_nats import start_nats


def test_one_engine_on_two_cores_gets_the_first_and_the_control_plane_the_second():
    assert plan_cpu_layout([0, 1], 1) == CpuLayout((frozenset({0}),), frozenset({1}))


def test_engines_get_equal_contiguous_slices_and_the_control_plane_the_rest():
    layout = plan_cpu_layout(range(8), 3)
    assert layout.engines == (frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}))
    assert layout.control == frozenset({6, 7})


def test_the_cores_this_process_may_use_are_laid_out_even_when_not_numbered_from_zero():
    layout = plan_cpu_layout([7, 3, 5], 2)
    assert layout.engines == (frozenset({3}), frozenset({5}))
    assert layout.control == frozenset({7})


@pytest.mark.parametrize(("cpus", "engines"), [([0, 1], 2), ([0], 1), ([0, 1, 2], 3)])
def test_no_layout_without_a_core_per_engine_plus_one(cpus, engines):
    assert plan_cpu_layout(cpus, engines) is None


def test_a_layout_for_no_engine_is_refused():
    with pytest.raises(ValueError):
        plan_cpu_layout([0, 1], 0)


def decide(mode="auto", engine="vllm", engines=1, autoscale=False, cpus=(0, 1), gpu=False):
    return cpu_layout_decision(mode, engine, engines, autoscale, cpus, gpu=lambda: gpu)


def test_auto_lays_out_vllm_on_a_cpu_host():
    decision = decide()
    assert decision.layout == plan_cpu_layout([0, 1], 1)
    assert decision.reason == "cpu layout: llumlets on cores 0; control plane on 1"


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"mode": "off"}, "off"),
        ({"engine": "sim"}, "sim engine"),
        ({"autoscale": True}, "autoscaler"),
        ({"engines": 2}, "2 cores for 2 llumlets"),
        ({"gpu": True}, "GPU"),
    ],
)
def test_no_layout_and_the_reason(kwargs, why):
    decision = decide(**kwargs)
    assert decision.layout is None and why in decision.reason


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="auto, off"):
        decide(mode="pinned")


def test_format_cpus_as_taskset_writes_them():
    assert format_cpus(frozenset({2, 3, 4})) == "2-4"
    assert format_cpus(frozenset({0, 2})) == "0,2"
    assert format_cpus(frozenset({5})) == "5"


def test_the_engine_follows_the_flag_then_the_environment(monkeypatch):
    monkeypatch.setenv("CORRAL_ENGINE", "sim")
    assert resolve_engine("vllm") == "vllm"
    assert resolve_engine(None) == "sim"


def affinity_of(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def test_a_child_keeps_to_the_cores_it_was_given():
    core = max(os.sched_getaffinity(0))
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=child_setup(frozenset({core})), capture_output=True, text=True, check=True,
    )
    assert child.stdout.strip() == f"[{core}]"


def test_a_child_without_cores_runs_anywhere():
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=child_setup(None), capture_output=True, text=True, check=True,
    )
    assert child.stdout.strip() == str(sorted(os.sched_getaffinity(0)))


def test_the_embedded_nats_server_keeps_to_its_cores():
    core = max(os.sched_getaffinity(0))
    server = start_nats(preexec_fn=keep_to(frozenset({core})))
    try:
        assert affinity_of(server.process.pid) == {core}
    finally:
        server.stop()
