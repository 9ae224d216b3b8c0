"""A migration's handover in `loadgen simulate` (issue 20), by the llumlets' rules: the source's
suspend waits for its step in flight, the destination's commit hold (`shared.policy.commit_hold`)
starts the step after the commit with the request in it, and the stall is counted."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.handover import Handovers
from loadgen.simulator.instance import SimInstance
from loadgen.simulator.migration import Migrator
from loadgen.simulator.migration_state import MigrationStats
from shared.engine_model.config import SchedulerConfig
from shared.policy.baselines import get_policy
from shared.policy.commit_hold import CommitHoldRule
from tests.simulator.helpers import synthetic

CONFIG = SimConfig(num_instances=4, scheduler=SchedulerConfig(num_blocks=1000, max_model_len=8192))


def held(rule: CommitHoldRule, notice_steps: int = CONFIG.migration.notice_steps) -> SimConfig:
    return replace(CONFIG, migration=replace(CONFIG.migration, hold=rule, notice_steps=notice_steps))


def workload(seed: int):
    return synthetic("conversation:long", 300, 1.0, CONFIG, trace_timestamps=True, seed=seed)


def suspends_mid_step(config: SimConfig) -> tuple[int, int]:
    """(suspends, suspends of a request in its instance's step in flight) over a run."""
    sim = ClusterSimulator(config, get_policy("corral"), workload(0))
    counts = [0, 0]
    for instance in sim.instances.values():
        def suspend(request_id, _suspend=instance.scheduler.suspend, _instance=instance):
            request = _instance.scheduler.get(request_id)
            counts[0] += 1
            counts[1] += _instance.step is not None and any(r is request for r in _instance.step.requests)
            return _suspend(request_id)
        instance.scheduler.suspend = suspend
    assert sim.run().migrations.committed > 0
    return counts[0], counts[1]


def test_the_source_suspends_a_request_only_between_its_steps(monkeypatch):
    suspends, mid_step = suspends_mid_step(CONFIG)
    assert suspends > 0 and mid_step == 0
    # Without the wait, last stages suspend requests in the step in flight (whose token is lost).
    monkeypatch.setattr(Handovers, "suspend_waits", lambda self, migration, request, last_stage_s, now: False)
    assert suspends_mid_step(CONFIG)[1] > 0


def test_every_migrated_request_produces_what_it_would_have_and_its_stall_is_counted():
    result = ClusterSimulator(held(CommitHoldRule(0.05)), get_policy("corral"), workload(1)).run()
    assert result.migrations.committed > 0
    assert len(result.migrations.stall_s) == result.migrations.committed
    assert min(result.migrations.stall_s) > CONFIG.migration.commit_overhead_s  # the last stage, then a step
    for r in result.finished:
        assert r.num_output_tokens == r.stop_at_output


def run_recording(monkeypatch, rule: CommitHoldRule, seed: int, notice_steps: int = 1):
    """The run's result; every hold (destination, when it began, how long at most, the migrations
    it waits for, whether paced, the rule's bound then); each migration's commit time; every step
    start per instance."""
    holds: list[tuple[SimInstance, float, float, set[str], bool, float]] = []
    commits: dict[str, float] = {}
    starts: dict[str, list[float]] = defaultdict(list)
    holds_step, commit, start_step = Handovers.holds_step, Migrator._commit, SimInstance.start_step

    def recording_holds_step(self, dst, now):
        held_before = dst.instance_id in self._holds
        waiting = holds_step(self, dst, now)
        if waiting and not held_before:
            _, ends, due, paced = self._holds[dst.instance_id]
            holds.append((dst, now, ends - now, set(due), paced, rule.bound_s(dst.typical_step_s)))
        return waiting

    def recording_commit(self, migration, request):
        commits[migration.migration_id] = self.sim.now
        commit(self, migration, request)

    def recording_start_step(self, now):
        duration = start_step(self, now)
        if duration is not None:
            starts[self.instance_id].append(now)
        return duration

    monkeypatch.setattr(Handovers, "holds_step", recording_holds_step)
    monkeypatch.setattr(Migrator, "_commit", recording_commit)
    monkeypatch.setattr(SimInstance, "start_step", recording_start_step)
    result = ClusterSimulator(held(rule, notice_steps), get_policy("corral"), workload(seed)).run()
    return result, holds, commits, starts


@pytest.mark.parametrize("seed", [0, 1])
def test_a_held_step_starts_at_the_commit_and_waits_at_most_its_share_of_a_step(monkeypatch, seed):
    """With a notice a step ahead (the default): no pacing, the hold as first built."""
    rule = CommitHoldRule(hold_max_s=1.0, step_share=0.5)
    result, holds, commits, starts = run_recording(monkeypatch, rule, seed, notice_steps=1)
    assert result.migrations.holds == len(holds) > 0 and result.migrations.paced_holds == 0
    all_in_time = 0
    for dst, at, bound, due, paced, bound_then in holds:
        assert due and not paced and bound == pytest.approx(bound_then)
        in_time = [commits[m] for m in due if commits.get(m, float("inf")) <= at + bound]
        if len(in_time) == len(due):  # the last of them started the held step
            all_in_time += 1
            step_at = max(in_time)
        else:  # one late (its expected time moved) or aborted: the step went at the bound
            step_at = at + bound
        assert step_at in starts[dst.instance_id], (at, bound, due)
        assert not [t for t in starts[dst.instance_id] if at <= t < step_at]  # and none before it
    assert all_in_time > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_the_hold_shortens_the_stall(seed):
    def stall_median(rule: CommitHoldRule) -> tuple[float, int]:
        result = ClusterSimulator(held(rule), get_policy("corral"), workload(seed)).run()
        return statistics.median(result.migrations.stall_s), result.migrations.holds

    off, no_holds = stall_median(CommitHoldRule())
    on, holds = stall_median(CommitHoldRule(hold_max_s=1.0, step_share=1.0))
    assert no_holds == 0 and holds > 0
    assert on < off


@pytest.mark.parametrize("seed", [0, 1])
def test_a_paced_step_waits_its_share_or_starts_at_the_commit_and_never_drops_it(monkeypatch, seed):
    """With the notice steps ahead: each paced hold within the rule's bound; its step starts when
    it ends, or at its commit where that came first; and the commit it paced for is held for
    again, in a later step (a paced hold does not give up on it)."""
    rule = CommitHoldRule(hold_max_s=1.0, step_share=0.5)
    result, holds, commits, starts = run_recording(monkeypatch, rule, seed, notice_steps=3)
    paced = [h for h in holds if h[4]]
    assert result.migrations.paced_holds == len(paced) > 0
    for dst, at, length, due, _, bound_then in paced:
        assert 0 < length <= bound_then + 1e-12
        (mid,) = due
        step_at = min(at + length, commits.get(mid, float("inf")))
        assert step_at in starts[dst.instance_id], (at, length, due)
        assert not [t for t in starts[dst.instance_id] if at <= t < step_at]
    caught = 0
    for mid in {mid for h in paced for mid in h[3]}:
        caught += any(mid in due and not is_paced for _, _, _, due, is_paced, _ in holds)
    assert caught > 0


@pytest.mark.parametrize("seed", [0, 2])
def test_noticing_steps_ahead_shortens_the_stall_more_than_a_step_ahead(seed):
    """Where the commit's phase in the destination's step is left to chance (a notice a step
    ahead), a commit due late in a step waits for the next; paced, nearly all are met. On
    decode-heavy traffic (steps of one length, as the pacing assumes) the stall's P90 falls, and
    its median does not rise. (On long-prompt traffic both are a destination step that carries a
    prefill chunk, which no hold shortens.)"""
    def stalls(notice_steps: int) -> list[float]:
        config = held(CommitHoldRule(hold_max_s=1.0, step_share=0.5), notice_steps)
        work = synthetic("synthetic:M-L", 300, 3.0, config, seed=seed)
        return ClusterSimulator(config, get_policy("corral"), work).run().migrations.stall_s

    one, three = stalls(1), stalls(3)
    assert len(one) > 10 and len(three) > 10
    assert statistics.median(three) <= statistics.median(one)
    assert statistics.quantiles(three, n=10)[-1] < statistics.quantiles(one, n=10)[-1]


def test_the_commit_is_expected_by_the_live_sources_estimate_not_by_when_its_step_will_end():
    """As `CommitNotifier.notice`: the step in flight ends a typical step after its start (the
    source cannot know when it will), then a typical step for each one left, then the last
    stage; at each next start again. (Was: the step's actual end, which only the simulator knows.)"""
    rule = CommitHoldRule(hold_max_s=1.0, step_share=0.5)
    request = object()
    src = SimpleNamespace(instance_id="s", step=SimpleNamespace(requests=[request]), typical_step_s=0.040,
                          step_started_at=1.000, step_ends_at=1.100)  # a long step: a prefill chunk in it
    dst = SimpleNamespace(instance_id="d", typical_step_s=0.040)
    for notice_steps, expected in ((1, 1.040 + 0.005), (3, 1.040 + 2 * 0.040 + 0.005)):
        handovers = Handovers(rule, MigrationStats(), notice_steps, wake=lambda instance, at: None)
        migration = SimpleNamespace(migration_id="m", src=src, dst=dst, commit_due_at=None)
        assert handovers.suspend_waits(migration, request, last_stage_s=0.005, now=1.010)
        assert migration.commit_due_at == pytest.approx(expected)
        # Past the typical end, the step is expected to end now.
        handovers = Handovers(rule, MigrationStats(), notice_steps, wake=lambda instance, at: None)
        assert handovers.suspend_waits(migration, request, last_stage_s=0.005, now=1.060)
        assert migration.commit_due_at == pytest.approx(expected + 0.020)
    src.step_started_at, src.step_ends_at = 1.100, 1.130  # the next step starts (three steps ahead)
    handovers.step_started(src)  # (uncounted here: `after_step` counts the steps down)
    assert migration.commit_due_at == pytest.approx(1.140 + 2 * 0.040 + 0.005)


def test_a_suspended_request_is_not_noticed_again(monkeypatch):
    """A live source sends nothing after the suspend: the commit stays expected when its notice
    said, not when the last stage will end (was: noticed again, exactly, at the suspend)."""
    expected: dict[str, list[bool]] = defaultdict(list)  # migration id -> suspended yet, per expectation
    expect_commit = Handovers.expect_commit

    def recording(self, migration, due_at):
        expected[migration.migration_id].append(migration.suspended_at is not None)
        expect_commit(self, migration, due_at)

    monkeypatch.setattr(Handovers, "expect_commit", recording)
    result = ClusterSimulator(held(CommitHoldRule(0.05)), get_policy("corral"), workload(0)).run()
    assert result.migrations.committed > 0
    noticed = [marks for marks in expected.values() if not marks[0]]
    assert noticed and all(not any(marks) for marks in noticed)


def test_a_migrations_holds_are_charged_what_they_took_as_each_ends_and_stop_at_its_budget():
    """As the live hold (`CommitHold`): charged at the hold's end, to the migrations it still
    waits for; one that commits meanwhile is forgotten, budget and all."""
    rule = CommitHoldRule(hold_max_s=1.0, step_share=0.5)  # a 40 ms step: 20 ms holds, 160 ms in all
    handovers = Handovers(rule, MigrationStats(), 1, wake=lambda instance, at: None)
    dst = SimpleNamespace(instance_id="d", typical_step_s=0.040, scheduler=SimpleNamespace(running=[]))

    def migration(mid: str) -> SimpleNamespace:
        return SimpleNamespace(migration_id=mid, dst=dst, src=SimpleNamespace(instance_id="s"), commit_due_at=0.0)

    honest = migration("honest")
    handovers.expect_commit(honest, 1.001)
    assert handovers.holds_step(dst, 1.000)
    handovers.forget(honest)  # (its commit at 1.001)
    assert not handovers.holds_step(dst, 1.001) and handovers.num_budgeted == 0

    stuck, now, held = migration("stuck"), 2.0, 0
    for _ in range(20):  # a source noticing at each step and never committing
        handovers.expect_commit(stuck, now + 0.001)
        if handovers.holds_step(dst, now):
            held += 1
            assert handovers.holds_step(dst, now + 0.010)  # (still within its bound)
            now += 0.030  # woken 10 ms past the bound: that is what it held
            assert not handovers.holds_step(dst, now)
        now += 0.040
    assert held == 6 and handovers.num_budgeted == 1  # 6 x 30 ms >= 160 ms (charged by the bound: 8)
