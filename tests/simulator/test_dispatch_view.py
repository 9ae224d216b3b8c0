"""The simulator's indexed dispatch (the live scheduler's `DispatchIndex`, kept by
loadgen.simulator.dispatch_view) decides exactly as the plain scan over every instance's report:
the same instance (or the same rejection) for every request, and so the same run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import AutoscaleModel
from loadgen.simulator.instance import SimInstance
from loadgen.simulator.workload import SimArrival, Workload, WorkloadSpec, build_workload
from shared.policy.baselines import get_policy
from shared.policy.config import PolicyConfig, ScalingConfig
from tests.simulator.helpers import SMALL, small, synthetic, trace_path


def _both(config, policy, workload):
    """(plain, indexed) runs, each with every dispatch recorded."""
    runs = []
    for indexed in (False, True):
        sim = ClusterSimulator(config, get_policy(policy), workload, record_dispatches=True, dispatch_index=indexed)
        assert (sim.indexed is not None) == indexed
        runs.append(sim.run())
    return runs


def _decisions(result):
    return [(d.request_id, d.instance_id, d.rejected, d.at_s) for d in result.dispatches]


def _outcome(result):
    return sorted((r.request_id, r.first_token_time, r.finished_time, r.num_preemptions) for r in result.finished)


def _assert_same(plain, indexed):
    assert _decisions(indexed) == _decisions(plain)
    assert _outcome(indexed) == _outcome(plain)
    assert indexed.migrations == plain.migrations
    assert indexed.num_steps == plain.num_steps


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["corral", "llumnix-base"])
def test_same_decisions_on_seeded_overload_with_migration(policy, seed):
    workload = synthetic("synthetic:L-L", 250, rate=6.0, priority_fraction=0.2, seed=seed)
    plain, indexed = _both(small(guard=None), policy, workload)
    assert plain.migrations.committed > 10  # instances' loads change under the index, not only by dispatch
    _assert_same(plain, indexed)
    # Ties are common on a fresh fleet: the instances chosen must not all be one.
    assert len({d.instance_id for d in indexed.dispatches}) == SMALL.num_instances


def test_same_decisions_on_a_larger_fleet_with_ties():
    """64 instances, most of them idle most of the time: many exact ties among empty instances."""
    config = replace(SMALL, num_instances=64)
    workload = synthetic("synthetic:M-M", 600, rate=40.0, config=config, seed=4)
    _assert_same(*_both(config, "corral", workload))


def test_same_decisions_with_early_rejection_by_freeness():
    config = small(policy=PolicyConfig(reject_below_freeness=2.0), guard=None)
    workload = synthetic("synthetic:L-L", 200, rate=12.0, config=config, seed=2)
    plain, indexed = _both(config, "corral", workload)
    assert 0 < len(plain.rejected) < 200
    _assert_same(plain, indexed)


def _autoscaled_load_step():
    """A config that scales out and back in, and its workload: busy, then quiet."""
    scaling = ScalingConfig(scale_out_below=10, scale_in_above=60, sustain_s=2, cooldown_s=4, min_instances=1,
                            max_instances=8)
    config = small(num_instances=2, autoscale=AutoscaleModel(scaling=scaling, startup_s=5.0))
    rows = synthetic("synthetic:M-M", 900, rate=12.0, config=config, seed=6).arrivals
    late = synthetic("synthetic:M-M", 100, rate=0.5, config=config, seed=7).arrivals
    shift = rows[-1].time_s
    arrivals = rows + [SimArrival(len(rows) + a.index, shift + a.time_s, a.prompt_len, a.output_len, a.priority)
                       for a in late]
    return config, Workload(arrivals, "load step")


def test_same_decisions_while_autoscaling_launches_and_drains():
    """Instances start serving after a startup delay (no report yet) and drain (ranked apart)."""
    config, workload = _autoscaled_load_step()
    plain, indexed = _both(config, "corral", workload)
    actions = [e.action for e in plain.scaling_events]
    assert "out" in actions and "in" in actions
    _assert_same(plain, indexed)
    assert indexed.scaling_events == plain.scaling_events


def test_same_decisions_on_a_real_trace():
    path = trace_path("BurstGPT_1.csv")
    config = replace(SMALL, num_instances=8)
    workload = build_workload(WorkloadSpec(f"burstgpt:{path}", num_requests=400, trace_timestamps=True, rate=10.0),
                              config.max_seq_len)
    _assert_same(*_both(config, "corral", workload))


def test_reports_remembered_stay_about_one_per_instance_after_the_last_arrival():
    """Migration rounds keep reporting while the last requests finish and no dispatch reads the
    queue: superseded entries must go, or it grows with every round of the tail."""
    workload = synthetic("synthetic:L-L", 60, rate=20.0, seed=1)  # arrivals in ~3 s, a long tail
    sim = ClusterSimulator(SMALL, get_policy("corral"), workload)
    result = sim.run()
    assert result.makespan_s > workload.duration_s + 10 and result.migrations.rounds > 100
    # (about one each: a superseded entry behind a later instance's current one goes when it
    # reaches the front; reports built at step ends as well leave a few such)
    assert sim.indexed.queued_reports <= 2 * SMALL.num_instances
    # Instances drained and stopped by the autoscaler leave it too.
    config, workload = _autoscaled_load_step()
    sim = ClusterSimulator(config, get_policy("corral"), workload)
    sim.run()
    stopped = sum(i.stopped_at is not None for i in sim.instances.values())
    assert stopped > 0 and sim.indexed.queued_reports <= len(sim.instances) - stopped


@pytest.mark.parametrize("policy", ["round-robin", "infaas++", "kv-cost"])
def test_other_dispatch_rules_keep_the_scan(policy):
    sim = ClusterSimulator(SMALL, get_policy(policy), synthetic("synthetic:M-M", 5, rate=1.0))
    assert sim.indexed is None


def test_a_step_that_moves_a_share_of_an_instances_blocks_is_reported_at_once(monkeypatch):
    """As a live llumlet (`LoadReports.soon_if_blocks_moved`), not only when a look finds the last
    one aged out: reports are built at step ends, unless the share is out of reach."""
    on_step_end, build_report = ClusterSimulator._on_step_end, SimInstance.build_report
    in_step_end, built_there = [False], [0]

    def step_end(self, instance):
        in_step_end[0] = True
        try:
            on_step_end(self, instance)
        finally:
            in_step_end[0] = False

    def build(self, now, max_model_len):
        built_there[0] += in_step_end[0]
        return build_report(self, now, max_model_len)

    def run(fraction: float) -> int:
        built_there[0] = 0
        config = replace(SMALL, report_change_fraction=fraction)
        result = ClusterSimulator(config, get_policy("corral"), synthetic("synthetic:L-L", 60, rate=20.0, seed=1)).run()
        assert len(result.finished) == 60
        return built_there[0]

    monkeypatch.setattr(ClusterSimulator, "_on_step_end", step_end)
    monkeypatch.setattr(SimInstance, "build_report", build)
    assert run(0.05) > 0 and run(2.0) == 0  # (twice the blocks: no step moves that many)
