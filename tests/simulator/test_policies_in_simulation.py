"""The simulator runs the shared policies on faithful snapshots, and the policies do what they
are for: de-fragmentation, priorities, auto-scaling."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from loadgen.simulator import cluster as cluster_module
from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import AutoscaleModel, SimConfig
from loadgen.simulator.instance import SimInstance
from loadgen.simulator.metrics import summarize
from shared.engine_model.config import SchedulerConfig
from shared.engine_model.load_report import aggregate_views
from shared.policy.baselines import DispatchRule, choose_least_loaded, get_policy
from shared.policy.config import HIGH_PRIORITY, ScalingConfig
from shared.policy.dispatch import choose_instance
from tests.simulator.helpers import SMALL, simulate, small, synthetic, workload_of


def test_incremental_report_counts_equal_the_request_views_through_a_run(monkeypatch):
    """The simulator's reports come from counts its schedulers keep up to date as requests
    arrive, queue, run, are preempted, migrate and end; at every report of a busy run (queues,
    priorities, migrations) they equal the aggregates of the request views a llumlet builds from."""
    checked = []
    original = SimInstance.build_report

    def checking(self, now, max_model_len):
        report = original(self, now, max_model_len)
        from_views = aggregate_views(self.scheduler.request_views())
        # (running_output_tokens is for live admission only: the simulator's reads its engines)
        assert self.scheduler.load() == dataclasses.replace(from_views, running_output_tokens=[])
        assert (report.num_running, report.num_waiting, report.by_priority) == (
            from_views.num_running, from_views.num_waiting, from_views.by_priority)
        prioritized = sum(level.num_running for level in report.by_priority if level.priority != 0)
        checked.append((report.num_running, report.num_waiting, prioritized, self.migrations_in))
        return report

    monkeypatch.setattr(SimInstance, "build_report", checking)
    result = simulate(SMALL, "corral", synthetic("synthetic:L-L", 120, rate=5.0, priority_fraction=0.3, seed=2))
    # Reports with a queue, without one but with prioritized requests running, and during an
    # incoming migration were checked.
    assert any(waiting > 0 for _, waiting, _, _ in checked)
    assert any(waiting == 0 and running > prioritized > 0 for running, waiting, prioritized, _ in checked)
    assert result.migrations.committed > 0 and any(incoming for *_, incoming in checked)


@pytest.mark.parametrize("policy", ["corral", "llumnix-base", "infaas++"])
def test_dispatch_decisions_are_the_shared_functions_on_the_reports(monkeypatch, policy):
    seen = []
    original = cluster_module.dispatch

    def spy(policy_, loads, request, config, turn, prefix=None):
        decision = original(policy_, loads, request, config, turn, prefix)
        seen.append((list(loads), request, config, decision))
        return decision

    monkeypatch.setattr(cluster_module, "dispatch", spy)
    workload = synthetic("synthetic:M-M", 150, rate=8.0, priority_fraction=0.2, seed=4)
    # The scan (tests/simulator/test_dispatch_view.py: the dispatch index decides the same).
    result = simulate(SMALL, policy, workload, record_dispatches=True, dispatch_index=False)
    scheduling = get_policy(policy)
    assert len(seen) == 150
    for loads, request, config, decision in seen:
        assert config == scheduling.policy_config(SMALL.policy)
        if scheduling.dispatch is DispatchRule.LEAST_MEMORY:
            assert decision == choose_least_loaded(loads, request)
        else:
            assert decision == choose_instance(loads, request, config)
    # Each request went where the decision said.
    assert [r.instance_id for r in result.dispatches] == [d.instance_id for *_, d in seen]
    # Between reports the scheduler's view counts its own dispatches (account_dispatch).
    assert any(l.num_waiting > 0 for loads, *_ in seen for l in loads)


def _fragmented_cluster(policy: str):
    """Every instance runs three requests that hold ~48 of 100 blocks when a prompt of 63
    blocks arrives: no instance has room for it, the cluster has plenty."""
    config = small(num_blocks=100, max_model_len=1600)
    rows = [(0.001 * i, 200, 400, 0) for i in range(12)]  # 13 blocks each, growing; ~12 s of decoding
    rows.append((1.5, 1000, 20, 0))
    result = simulate(config, policy, workload_of(rows))
    long_prompt = next(r for r in result.finished if r.request_id == "r12")
    return long_prompt, result


def test_defragmentation_places_a_long_prompt_sooner_than_infaas():
    corral_long, corral = _fragmented_cluster("corral")
    infaas_long, infaas = _fragmented_cluster("infaas++")
    background_done = min(r.finished_time for r in infaas.finished if r.request_id != "r12")
    assert infaas_long.first_scheduled_time >= background_done - 0.5  # it waited for room
    assert corral.migrations.committed >= 1
    assert corral_long.first_scheduled_time < 3.0  # placed after migrations made room
    assert corral_long.first_token_time - 1.5 < 0.3 * (infaas_long.first_token_time - 1.5)


def test_high_priority_gets_lower_ttft_under_load_with_corral():
    workload = synthetic("synthetic:L-L", 300, rate=8.0, priority_fraction=0.2, seed=5)
    metrics = summarize(simulate(SMALL, "corral", workload), SMALL.block_bytes)
    high, normal = metrics.by_class["high"], metrics.by_class["normal"]
    assert normal.prefill.mean_s > 1.0  # the load does queue requests
    assert high.prefill.mean_s < 0.5 * normal.prefill.mean_s
    assert high.e2e.mean_s < normal.e2e.mean_s


def test_high_priority_gets_lower_tpot_when_admitted_requests_outgrow_memory():
    """The live priority test's scenario: 2 instances of 160 blocks, short prompts and long outputs
    arriving faster than they finish. Normal requests are the preemption victims; high-priority
    ones jump the queue and keep running."""
    order = [0] * 60
    for k in range(10):
        order.insert(20 + k * 5, HIGH_PRIORITY)
    workload = workload_of([(i * 0.02 / 0.3, 100, 300, p) for i, p in enumerate(order)])
    config = SimConfig(num_instances=2, scheduler=SchedulerConfig(num_blocks=160, max_model_len=2048, step_mode="v1"))
    metrics = summarize(simulate(config, "corral", workload), config.block_bytes)
    high, normal = metrics.by_class["high"], metrics.by_class["normal"]
    assert metrics.num_preemptions > 0 and high.num_preempted == 0
    assert high.prefill.mean_s < 0.1 * normal.prefill.mean_s
    assert high.decode.mean_s < 0.8 * normal.decode.mean_s


def _load_step_workload():
    """60 s at 12 req/s, then 240 s at 0.5 req/s."""
    rng = np.random.default_rng(0)
    rows, t = [], 0.0
    while t < 300:
        t += rng.exponential(1 / 12 if t < 60 else 1 / 0.5)
        rows.append((t, int(rng.integers(50, 400)), int(rng.integers(100, 400)), 0))
    return workload_of(rows)


@pytest.mark.parametrize("policy", ["corral", "infaas++"])
def test_autoscaling_adds_instances_on_a_load_step_and_drains_them(policy):
    scaling = ScalingConfig(scale_out_below=10, scale_in_above=60, sustain_s=2, cooldown_s=4, min_instances=1,
                            max_instances=8)
    config = small(num_instances=2, autoscale=AutoscaleModel(scaling=scaling, startup_s=5.0))
    workload = _load_step_workload()
    sim = ClusterSimulator(config, get_policy(policy), workload)
    result = sim.run()
    actions = [e.action for e in result.scaling_events]
    assert "out" in actions and "in" in actions
    assert actions.index("out") < len(actions) - 1 - actions[::-1].index("in")  # scaled in after scaling out
    assert max(result.timeline.live) > 2
    assert result.timeline.live[-1] < max(result.timeline.live)
    assert len({r.request_id for r in result.finished}) == len(workload.arrivals)  # nothing lost
    drained = [i for i in sim.instances.values() if i.stopped_at is not None]
    assert drained and all(i.is_empty() for i in drained)
    assert result.instance_seconds < len(sim.instances) * result.makespan_s


def test_llumnix_base_ignores_priorities():
    workload = synthetic("synthetic:L-L", 200, rate=8.0, priority_fraction=0.2, seed=5)
    result = simulate(SMALL, "llumnix-base", workload)
    assert all(r.priority == 0 for r in result.finished)
    assert sum(p == HIGH_PRIORITY for p in result.labels.values()) == 40
