"""The cluster simulation: determinism, conservation of requests, sane metrics per policy."""

from __future__ import annotations

import math

import pytest

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.metrics import summarize
from shared.policy.baselines import POLICY_NAMES, get_policy
from tests.simulator.helpers import SMALL, simulate, small, synthetic, workload_of


def _fingerprint(result):
    return sorted((r.request_id, r.first_token_time, r.finished_time, r.num_preemptions) for r in result.finished)


def test_same_seed_same_result():
    workload = synthetic("synthetic:L-L", 150, rate=3.0, config=SMALL, seed=7)
    first = simulate(SMALL, "corral", workload)
    second = simulate(SMALL, "corral", synthetic("synthetic:L-L", 150, rate=3.0, config=SMALL, seed=7))
    assert _fingerprint(first) == _fingerprint(second)
    assert first.migrations.committed == second.migrations.committed
    assert _fingerprint(first) != _fingerprint(simulate(SMALL, "corral", synthetic("synthetic:L-L", 150, 3.0, seed=8)))


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_each_policy_completes_with_sane_metrics(policy):
    workload = synthetic("synthetic:M-M", 200, rate=6.0, priority_fraction=0.2, seed=1)
    result = simulate(SMALL, policy, workload)
    metrics = summarize(result, SMALL.block_bytes)
    assert metrics.completed == 200 and metrics.rejected == 0
    assert sum(c.count for c in metrics.by_class.values()) == 200
    assert metrics.by_class["high"].count == 40
    for r in result.finished:
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finished_time
        assert r.preemption_loss_s >= 0
    overall = metrics.overall
    for stats in (overall.prefill, overall.decode, overall.e2e):
        assert 0 < stats.mean_s <= stats.p99_s and math.isfinite(stats.p99_s)
    assert overall.prefill.p99_s <= overall.e2e.p99_s
    assert metrics.output_tokens == sum(min(a.output_len, SMALL.max_seq_len - a.prompt_len) for a in workload.arrivals)
    assert metrics.instance_hours == pytest.approx(4 * metrics.makespan_s / 3600)
    if not get_policy(policy).migration:
        assert metrics.migrations["started"] == 0


def test_migration_conserves_requests():
    """Aggressive migration (no anti-thrash guard) on an overloaded small cluster: every request
    finishes exactly once, with exactly its output length, and nothing is left behind."""
    config = small(guard=None)
    workload = synthetic("synthetic:L-L", 250, rate=6.0, config=config, seed=3)
    sim = ClusterSimulator(config, get_policy("llumnix-base"), workload)
    result = sim.run()
    assert result.migrations.committed > 20
    ids = [r.request_id for r in result.finished]
    assert len(ids) == len(set(ids)) == 250
    expected = {f"r{a.index}": min(a.output_len, config.max_seq_len - a.prompt_len) for a in workload.arrivals}
    assert {r.request_id: r.num_output_tokens for r in result.finished} == expected
    for instance in sim.instances.values():
        instance.scheduler.check_invariants()
        assert instance.is_empty()


def test_round_robin_spreads_evenly():
    workload = workload_of([(0.01 * i, 100, 10, 0) for i in range(40)])
    result = simulate(SMALL, "round-robin", workload, record_dispatches=True)
    counts: dict[str, int] = {}
    for record in result.dispatches:
        counts[record.instance_id] = counts.get(record.instance_id, 0) + 1
    assert counts == {"i000": 10, "i001": 10, "i002": 10, "i003": 10}
    assert [r.instance_id for r in result.dispatches[:5]] == ["i000", "i001", "i002", "i003", "i000"]


def test_too_long_prompt_is_rejected_not_crashed():
    workload = workload_of([(0.0, 100, 5, 0), (0.1, SMALL.max_seq_len, 5, 0)])
    result = simulate(SMALL, "corral", workload)
    assert len(result.finished) == 1
    assert [r.rejected for r in result.rejected] == ["prompt is longer than any instance's max_model_len"]
