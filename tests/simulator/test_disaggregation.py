"""P/D disaggregation in the simulator (issue 19 §2): new requests land on prefill instances,
each is handed off at its first token by the staged live migration (KV copy cost from bytes and
bandwidth), the prompt's blocks are freed on the source at the commit, a request stays where it
is when no decode instance has room, and nothing is lost. Without roles nothing changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.errors import LoadgenError
from loadgen.simulator import cli
from loadgen.simulator import handoff as handoff_module
from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import MigrationModel
from loadgen.simulator.handoff import Handoffs
from loadgen.simulator.migration import Migrator
from loadgen.simulator.migration_state import Migration, MigrationStatus
from shared.messages import InstanceRole
from shared.policy.baselines import get_policy
from shared.policy.disaggregation import HANDOFF_ATTEMPTS, HANDOFF_RETRY_AFTER_S
from tests.simulator.helpers import simulate, small, synthetic, workload_of
from tests.simulator.test_cli import parse

PD = small(num_instances=4, num_prefill=1, num_decode=3, step_mode="v1", num_blocks=400)


def assert_nothing_lost(sim: ClusterSimulator, n: int) -> None:
    result = sim._result(0.0)
    assert len(result.finished) == n and not result.rejected
    for r in result.finished:
        assert r.num_output_tokens == r.stop_at_output, r.request_id  # max_tokens, or the sequence limit
    for instance in sim.instances.values():  # every block back, no lease left behind
        blocks = instance.scheduler.block_manager
        assert instance.is_empty() and blocks.num_free == instance.scheduler.config.num_blocks, instance.instance_id


def run(config, policy: str, workload, **kwargs) -> ClusterSimulator:
    sim = ClusterSimulator(config, get_policy(policy), workload, **kwargs)
    sim.run()
    return sim


@pytest.mark.parametrize("policy", ["corral", "infaas++"])
def test_every_request_is_handed_off_to_a_decode_instance(monkeypatch, policy):
    commits: list[tuple[str, str, str]] = []  # (request, source role, destination role)
    original = Handoffs._on_migration_finished

    def check(self, migration: Migration) -> None:
        if migration.handoff and migration.status is MigrationStatus.COMMITTED:
            # the prompt's blocks left the prefill instance at the commit; the destination holds them
            assert migration.src.scheduler.block_manager.num_blocks_of(migration.request_id) == 0
            assert migration.src.scheduler.get(migration.request_id) is None
            assert migration.dst.scheduler.block_manager.num_blocks_of(migration.request_id) > 0
            commits.append((migration.request_id, migration.src.role, migration.dst.role))
        original(self, migration)

    monkeypatch.setattr(Handoffs, "_on_migration_finished", check)
    workload = workload_of([(0.3 * i, 300 + 40 * i, 64, 0) for i in range(20)])  # light: room everywhere
    sim = run(PD, policy, workload, record_dispatches=True)
    assert_nothing_lost(sim, 20)
    stats = sim.handoffs.stats
    assert stats.prefilled == 20 and stats.committed == 20
    assert stats.degraded == stats.aborted == stats.finished_waiting == 0
    assert sorted(c[0] for c in commits) == sorted(f"r{i}" for i in range(20))
    assert all(src is InstanceRole.PREFILL and dst is InstanceRole.DECODE for _, src, dst in commits)
    # new requests only ever went to the prefill instance
    assert {d.instance_id for d in sim.dispatches} == {"i000"}


def test_first_token_comes_from_the_prefill_instance_before_the_hand_off():
    workload = workload_of([(0.0, 1000, 32, 0)])
    mixed = simulate(small(num_instances=2, step_mode="v1", num_blocks=400), "corral", workload)
    pd = run(small(num_instances=2, num_prefill=1, num_decode=1, step_mode="v1", num_blocks=400), "corral", workload)
    [alone], [handed] = mixed.finished, pd._result(0.0).finished
    assert handed.first_token_time == alone.first_token_time  # the hand-off costs TTFT nothing
    assert handed.finished_time > alone.finished_time  # ... and decode pays the copy and the stop
    assert pd.handoffs.stats.committed == 1


def test_kv_transfer_time_follows_bytes_and_bandwidth():
    workload = workload_of([(0.0, 1600, 64, 0)])  # 100 blocks of 16 tokens × 0.5 MiB
    durations = {}
    for gbps in (1.0, 100.0):
        config = small(num_instances=2, num_prefill=1, num_decode=1, step_mode="v1", num_blocks=400,
                       migration=MigrationModel(bandwidth_gbps=gbps))
        sim = run(config, "infaas++", workload)  # no load-balancing rounds: the one migration is the hand-off
        [durations[gbps]] = sim.migrator.stats.duration_s
        assert sim.migrator.stats.copied_blocks >= 100
    prompt_bytes = 100 * PD.block_bytes
    assert durations[1.0] >= prompt_bytes / 1e9 > 0.8  # ~0.84 s for 839 MB at 1 GB/s
    assert durations[100.0] < 0.1 < durations[1.0]


def test_request_stays_on_the_prefill_instance_when_no_decode_instance_has_room():
    # 200 blocks each: the first long request fills most of the decode instance; the guard's 10 %
    # margin leaves no room for the second, which decodes where it was prefilled.
    config = small(num_instances=2, num_prefill=1, num_decode=1, step_mode="v1", num_blocks=200)
    workload = workload_of([(0.0, 1500, 400, 0), (0.5, 1500, 64, 0)])
    sim = run(config, "infaas++", workload)
    assert_nothing_lost(sim, 2)
    stats = sim.handoffs.stats
    assert (stats.prefilled, stats.committed, stats.degraded) == (2, 1, 1)


def test_busy_fleet_loses_nothing_and_every_first_token_is_settled():
    workload = synthetic("synthetic:L-L", 150, rate=6.0, config=PD, seed=3)
    sim = run(PD, "corral", workload)
    assert_nothing_lost(sim, 150)
    s = sim.handoffs.stats
    assert s.committed > 0
    settled = s.committed + s.degraded + s.finished_waiting + s.rebalanced
    assert not any(sim.handoffs.pending.values())
    assert settled == s.prefilled == sum(r.stop_at_output > 1 for r in sim._result(0.0).finished)


def test_decode_instances_without_a_prefill_instance_change_nothing():
    """Roles with no prefill instance: every instance takes new requests, nothing hands off, and
    the run is the all-mixed run."""
    workload = synthetic("synthetic:M-M", 80, rate=6.0, config=PD, seed=1)
    mixed = simulate(small(num_instances=4, step_mode="v1", num_blocks=400), "corral", workload)
    decode_only = simulate(small(num_instances=4, num_decode=4, step_mode="v1", num_blocks=400), "corral", workload)
    key = lambda r: (r.request_id, r.first_token_time, r.finished_time)  # noqa: E731
    assert sorted(map(key, decode_only.finished)) == sorted(map(key, mixed.finished))
    assert decode_only.handoffs.prefilled == 0 and mixed.handoffs is None


def test_cli_flags_and_their_errors(capsys):
    args = parse("--dataset", "synthetic:M-S", "--num-requests", "30", "--rate", "4", "--instances", "3",
                 "--prefill", "1", "--decode", "2", "--policy", "corral", "--quiet")
    assert args.handler(args) == 0
    assert "P/D hand-offs (1 prefill, 2 decode, 0 mixed)" in capsys.readouterr().out
    with pytest.raises(LoadgenError, match="do not fit"):
        cli.build_config(parse("--dataset", "synthetic:M-S", "--instances", "3", "--prefill", "2", "--decode", "2"))
    with pytest.raises(LoadgenError):
        cli.build_config(parse("--dataset", "synthetic:M-S", "--prefill", "-1"))


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_prefill_instance_runs_at_most_its_hand_off_concurrency(monkeypatch, concurrency):
    peak = []
    original = Migrator.start

    def start(self, src, dst, request_id, *, handoff=False):
        migration = original(self, src, dst, request_id, handoff=handoff)
        peak.append(src.migrations_out)
        return migration

    monkeypatch.setattr(Migrator, "start", start)
    config = replace(PD, migration=MigrationModel(bandwidth_gbps=1.0, handoff_concurrency=concurrency))
    workload = workload_of([(0.01 * i, 800, 200, 0) for i in range(30)])  # a burst: first tokens close together
    sim = run(config, "infaas++", workload)
    assert_nothing_lost(sim, 30)
    assert max(peak) == concurrency  # reached, never passed
    assert sim.handoffs.stats.wait_s and max(sim.handoffs.stats.wait_s) > 0  # some waited for a slot


@pytest.mark.parametrize("no_room_answers", [1, HANDOFF_ATTEMPTS])
def test_no_room_is_asked_about_again_then_the_request_stays(monkeypatch, no_room_answers):
    """As the llumlet: "no room" is asked about again HANDOFF_RETRY_AFTER_S later, HANDOFF_ATTEMPTS
    times in all; the request decodes on its prefill instance meanwhile, and stays after the last."""
    calls: list[float] = []
    real = handoff_module.handoff_destination

    def no_room_at_first(source, loads, request_blocks, guard, headroom, request_max_tokens=0):
        calls.append(sim.now)
        return None if len(calls) <= no_room_answers else real(source, loads, request_blocks, guard, headroom,
                                                                request_max_tokens)

    monkeypatch.setattr(handoff_module, "handoff_destination", no_room_at_first)
    config = small(num_instances=2, num_prefill=1, num_decode=1, step_mode="v1", num_blocks=400)
    sim = ClusterSimulator(config, get_policy("infaas++"), workload_of([(0.0, 500, 200, 0)]))
    sim.run()
    assert_nothing_lost(sim, 1)
    s = sim.handoffs.stats
    assert s.retried == min(no_room_answers, HANDOFF_ATTEMPTS - 1)
    assert calls[1] - calls[0] == pytest.approx(HANDOFF_RETRY_AFTER_S)
    if no_room_answers < HANDOFF_ATTEMPTS:
        assert (s.committed, s.degraded) == (1, 0) and len(calls) == no_room_answers + 1
    else:
        assert (s.committed, s.degraded) == (0, 1) and len(calls) == HANDOFF_ATTEMPTS


def test_a_hand_off_that_starts_at_the_first_token_moves_in_one_stage(monkeypatch):
    """As the llumlet: taken out of the batch before the prefill instance's next step (which may
    carry other prompts' prefill), and moved in one stage; a queued one keeps decoding first."""
    at_once: list[Migration] = []
    start = Migrator.start

    def recording_start(self, src, dst, request_id, *, handoff=False):
        migration = start(self, src, dst, request_id, handoff=handoff)
        if handoff and migration.stages and migration.stages[0][1]:
            at_once.append(migration)
        return migration

    monkeypatch.setattr(Migrator, "start", recording_start)
    workload = workload_of([(0.3 * i, 300 + 40 * i, 64, 0) for i in range(20)])
    sim = run(PD, "corral", workload)
    assert_nothing_lost(sim, 20)
    assert len(at_once) == sim.handoffs.stats.committed == 20  # light load: every one at once
    assert sim.migrator.stats.holds == 0  # moved without a notice: no decode instance held a step for it
    assert all(m.stages == [(m.stages[0][0], True)] and m.status is MigrationStatus.COMMITTED for m in at_once)
    # The request left before decoding there: it has its first token only, from the prefill instance.
    assert all(m.stages[0][0] == -(-(300 + 40 * int(m.request_id[1:]) + 1) // 16) for m in at_once)


@pytest.mark.parametrize("told", [True, False])
def test_a_hand_off_goes_to_a_destination_under_its_limit_of_migrations_in(monkeypatch, told):
    """Reports tell each instance's migrations in and its limit, and the scheduler hands off only
    to one under it (`may_take_handoff`). Where a report does not tell (an older llumlet), the
    destination refuses at its limit (ABORTED_DST, as live) and that is an attempt spent."""
    granted: list[bool] = []
    grants = Migrator.destination_grants

    def recording(self, dst, num_blocks):
        granted.append(grants(self, dst, num_blocks))
        return granted[-1]

    monkeypatch.setattr(Migrator, "destination_grants", recording)
    config = replace(small(num_instances=2, num_prefill=1, num_decode=1, step_mode="v1", num_blocks=400),
                     migration=MigrationModel(bandwidth_gbps=0.5, max_in=1, handoff_concurrency=4))
    sim = ClusterSimulator(config, get_policy("infaas++"),
                           workload_of([(0.0, 600, 200, 0), (0.0, 600, 200, 0), (0.0, 600, 200, 0)]))
    for instance in sim.instances.values():
        instance.max_migrations_in = instance.max_migrations_in if told else 0
    sim.run()
    assert_nothing_lost(sim, 3)
    s = sim.handoffs.stats
    assert s.committed + s.degraded + s.finished_waiting + s.rebalanced == s.prefilled == 3
    if told:
        assert granted and all(granted) and s.aborted == 0  # never asked one at its limit
    else:
        assert False in granted and s.aborted == granted.count(False) and s.retried > 0


def test_a_hand_off_its_source_gave_up_is_not_asked_about_again(monkeypatch):
    """As live (the source's abort is not ABORTED_DST: GONE): a request whose hand-off its
    prefill instance gave up stays there (was: asked about again)."""
    aborted: list[bool] = []
    stage_end = Migrator._on_stage_end

    def the_source_gives_up_once(self, migration):
        if migration.handoff and not aborted:
            self._abort(migration, "preempted on the source")  # (what the source's check raises)
            aborted.append(migration.refused_by_destination)
            return
        stage_end(self, migration)

    monkeypatch.setattr(Migrator, "_on_stage_end", the_source_gives_up_once)
    config = small(num_instances=2, num_prefill=1, num_decode=1, step_mode="v1", num_blocks=400)
    sim = run(config, "infaas++", workload_of([(0.0, 500, 200, 0)]))
    assert_nothing_lost(sim, 1)
    s = sim.handoffs.stats
    assert aborted == [False] and (s.aborted, s.retried, s.degraded, s.committed) == (1, 0, 1, 0)
