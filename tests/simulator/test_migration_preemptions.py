"""Migration must not cause preemptions: with v1 chunked prefill an admitted long prompt still
has blocks to claim, and neither the destination guard nor the lease may take them."""

from __future__ import annotations

from collections import defaultdict

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from shared.engine_model.scheduler import SimScheduler
from shared.policy.baselines import DispatchRule, SchedulingPolicy, get_policy
from tests.simulator.helpers import small, synthetic

# 4 A10-sized instances under heavy long-prompt conversation traffic (prompts cut to 8k).
CONFIG = small(num_blocks=851, max_model_len=8192, step_mode="v1")
CORRAL_WITHOUT_MIGRATION = SchedulingPolicy("corral-no-migration", DispatchRule.FREENESS, migration=False,
                                            priorities=True, description="corral, migration off")


def workload(seed: int = 1):
    return synthetic("conversation:long", 500, rate=0.8, config=CONFIG, trace_timestamps=True, seed=seed)


def run(policy: SchedulingPolicy, seed: int = 1) -> tuple[int, int, int]:
    """(preemptions, preemptions within 1 s after a migration committed into the same instance,
    migrations committed)."""
    sim = ClusterSimulator(CONFIG, policy, workload(seed))
    commits: dict[str, list[float]] = defaultdict(list)
    preempted: list[tuple[str, float]] = []
    for instance_id, instance in sim.instances.items():
        scheduler = instance.scheduler

        def add_migrated(request, lease_id, _add=scheduler.add_migrated, _id=instance_id):
            commits[_id].append(sim.now)
            return _add(request, lease_id)

        def preempt(request, out, now, _preempt=scheduler._preempt, _id=instance_id):
            preempted.append((_id, sim.now))
            return _preempt(request, out, now)

        scheduler.add_migrated, scheduler._preempt = add_migrated, preempt
    result = sim.run()
    soon = sum(any(0 <= t - c <= 1.0 for c in commits[i]) for i, t in preempted)
    return result.num_preemptions, soon, result.migrations.committed


def test_migration_into_an_instance_does_not_raise_its_preemptions(monkeypatch):
    # Totals over three seeds: one run's total moves by several either way with any change of
    # timing (a notice three steps ahead moved 24, 27 and 19 on seeds 1-3 to 21, 18 and 31,
    # against 34, 29 and 30 without migration; a variant tried on the way had seed 1 at 39, none
    # of its 15 more during a migration).
    without = sum(run(CORRAL_WITHOUT_MIGRATION, seed)[0] for seed in (1, 2, 3))
    with_migration = []
    for seed in (1, 2, 3):
        preemptions, soon_after, committed = run(get_policy("corral"), seed)
        assert committed > 20  # migration did run
        assert soon_after == 0
        with_migration.append(preemptions)
    assert sum(with_migration) <= without
    # The same run with the fix off (nothing counts the blocks admitted prompts still claim):
    # migrations land on them, and the next prefill chunk preempts.
    monkeypatch.setattr(SimScheduler, "committed_blocks", lambda self: 0)
    unfixed, unfixed_soon_after, _ = run(get_policy("corral"))
    assert unfixed_soon_after > 0
    assert unfixed > with_migration[0]


def test_corral_is_llumnix_base_at_zero_high_priority_in_v1():
    """They differ only in the local queue (priority heap vs FCFS): with one priority level both
    admit in arrival order and preempt the same victim, so every request's latency is the same."""
    # 16 instances: enough migrations in for the victim choice to matter (with vLLM's arrival-time
    # tie-break Corral preempted 57 times here and Llumnix-base 60).
    config = SimConfig().with_scheduler(step_mode="v1")
    work = synthetic("conversation:long", 1500, rate=3.0, config=config, trace_timestamps=True, seed=0)
    runs = [ClusterSimulator(config, get_policy(name), work).run() for name in ("corral", "llumnix-base")]
    ttfts = [sorted((r.request_id, r.first_token_time) for r in result.finished) for result in runs]
    assert runs[0].num_preemptions == runs[1].num_preemptions
    assert ttfts[0] == ttfts[1]
