"""The destination's hold for an imminent commit (issue 20): the step clock, the hold's rules
and bound, its wiring into the destination registry (notice, commit, abort), and the source's
notice ahead of the suspend."""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
import pytest

from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.migration.commit_hold import CommitHold, StepClock
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.destination import IncomingMigrations
from services.llumlet.migration.kv_wire import FrameHeader
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus, new_migration_id
from shared.messages import CommitNotice, MigrationAbort, MigrationCommit, PreAlloc, PreAllocReply, WireError, decode, encode
from shared.policy.commit_hold import HOLD_BUDGET_STEPS, CommitHoldRule
from tests.unit.migration_helpers import expected_tokens, gen, sim_config
from tests.unit.migration_source_harness import make_harness  # noqa: F401 (fixture)


def stepped(clock: StepClock, durations: list[float]) -> StepClock:
    now = 100.0
    for d in durations:
        clock.started(now)
        clock.ended(now + d)
        now += d
    return clock


# -- the step clock ------------------------------------------------------------------------------


def test_the_step_clock_knows_the_typical_step_and_what_is_left_of_the_one_in_flight() -> None:
    now = [0.0]
    clock = stepped(StepClock(lambda: now[0]), [0.040, 0.041, 0.300, 0.039])  # (a prefill among decodes)
    assert clock.typical_s == pytest.approx(0.0405)
    assert clock.left_s() == 0.0  # none in flight
    clock.started(1.000)
    now[0] = 1.010
    assert clock.left_s() == pytest.approx(0.0305)
    now[0] = 1.100
    assert clock.left_s() == 0.0  # late: never negative


def test_the_step_clock_asserts_its_transitions_where_they_start() -> None:
    clock = StepClock()
    with pytest.raises(AssertionError):
        clock.ended(1.0)
    clock.started(1.0)
    with pytest.raises(AssertionError):
        clock.started(1.1)


async def test_next_start_wakes_at_the_next_step_or_times_out() -> None:
    clock = StepClock()
    assert not await clock.next_start(0.01)
    waiter = asyncio.create_task(clock.next_start(1.0))
    await asyncio.sleep(0)
    clock.started(time.monotonic())
    assert await waiter


# -- the hold ------------------------------------------------------------------------------------


def hold_of(hold_max_s: float, typical_step_s: float = 0.040, step_share: float = 1.0) -> CommitHold:
    return CommitHold(hold_max_s, stepped(StepClock(), [typical_step_s] * 3), step_share=step_share)


async def test_nothing_due_means_no_hold() -> None:
    hold = hold_of(0.5)
    assert await hold.wait() == 0.0 and hold.num_holds == 0


async def test_a_step_waits_for_a_commit_due_and_goes_the_moment_it_lands() -> None:
    hold = hold_of(1.0)
    hold.expect("m", 0.005)
    asyncio.get_running_loop().call_later(0.02, hold.settle, "m")
    held = await hold.wait()
    assert 0.015 <= held < 0.5  # woken by the commit, far short of the bound
    assert hold.num_holds == 1 and hold.num_released_at_bound == 0 and hold.num_expected == 0


async def test_a_migration_that_commits_during_its_hold_leaves_no_budget_behind() -> None:
    # was: the hold charged its time to every migration it waited for after the wait, those that
    # had settled meanwhile too, and nothing removed them again (an entry per held commit, for ever)
    hold = hold_of(1.0)
    for n in range(20):
        hold.expect(f"m{n}", 0.001)
        asyncio.get_running_loop().call_later(0.002, hold.settle, f"m{n}")
        assert await hold.wait() > 0.0
    assert hold.num_holds == 20 and hold.num_expected == 0 and hold.num_budgeted == 0
    hold.expect("late", 0.001)  # (one that does not come within the bound keeps its charge)
    hold.rule = CommitHoldRule(0.003, 1.0)
    await hold.wait()
    assert hold.num_budgeted == 1


async def test_a_commit_that_never_comes_releases_the_hold_at_its_bound_and_holds_nothing_again() -> None:
    hold = hold_of(0.03)
    hold.expect("m", 0.001)  # then the source died, or the migration ended without a word here
    held = await hold.wait()
    assert 0.03 <= held < 0.3
    assert hold.num_released_at_bound == 1 and hold.num_expected == 0
    assert await hold.wait() == 0.0  # the next step is not held for it again


async def test_a_source_repeating_its_notice_without_committing_holds_at_most_its_budget() -> None:
    # was: each notice re-armed the hold, so a source that never committed held every step
    hold = hold_of(0.003, typical_step_s=0.004)
    budget = hold.rule.budget_s(0.004)
    assert budget == pytest.approx(HOLD_BUDGET_STEPS * 0.004)
    held = 0.0
    for _step in range(40):
        hold.expect("m", 0.0)
        held += await hold.wait()
    assert budget <= held < budget + 0.01 and hold.num_holds < 40 and hold.num_expected == 0
    assert not hold.expect("m", 0.0)  # not believed until the migration ends here
    hold.settle("m")  # (it ended: a migration of that id may hold again)
    assert hold.expect("m", 0.0) and hold.num_expected == 1


async def test_no_hold_for_a_commit_due_after_a_step_started_now_would_end() -> None:
    hold = hold_of(0.5, typical_step_s=0.010)
    hold.expect("later", 0.030)  # a step now ends before it: the request joins the step after, as early
    assert await hold.wait() == 0.0
    hold.expect("later", 0.030, paced=True)  # noticed steps ahead: this step is paced for it instead
    assert await hold.wait() < 0.008 and hold.num_paced_holds == 1 and hold.num_expected == 1
    hold = hold_of(0.005, typical_step_s=0.040)
    hold.expect("past the bound", 0.020)
    assert await hold.wait() == 0.0
    assert hold.num_expected == 1  # (a later step may still hold for it)


async def test_a_step_share_bounds_the_hold_by_this_engines_steps() -> None:
    hold = hold_of(0.5, typical_step_s=0.040, step_share=0.5)
    assert hold.bound_s() == pytest.approx(0.020)
    hold.expect("past half a step", 0.030)  # the step goes: the request waits for the next one
    assert await hold.wait() == 0.0 and hold.num_expected == 1
    hold = hold_of(0.5, typical_step_s=0.040, step_share=0.5)
    hold.expect("never comes", 0.010)
    held = await hold.wait()
    assert 0.020 <= held < 0.2  # released at half a step, not at the 0.5 s bound
    assert hold_of(0.5, typical_step_s=0.0, step_share=0.5).bound_s() == 0.5  # no step known yet
    with pytest.raises(ValueError):
        hold_of(0.5, step_share=0.0)


async def test_a_notice_overdue_by_more_than_a_hold_is_dropped() -> None:
    hold = hold_of(0.01)
    hold.expect("m", 0.0)
    await asyncio.sleep(0.03)
    assert await hold.wait() == 0.0 and hold.num_expected == 0


async def test_a_zero_bound_never_holds() -> None:
    hold = hold_of(0.0)
    assert not hold.enabled
    hold.expect("m", 0.0)
    assert hold.num_expected == 0 and await hold.wait() == 0.0
    with pytest.raises(ValueError):
        CommitHold(-0.001, StepClock())
    with pytest.raises(ValueError):
        MigrationLimits(hold_max_s=-1.0)


# -- the wire ------------------------------------------------------------------------------------


def test_the_notice_and_the_grant_field_decode_and_old_grants_mean_no_hold() -> None:
    assert decode(encode(CommitNotice("m", 0.042)), CommitNotice) == CommitNotice("m", 0.042)
    old = msgspec.msgpack.encode({"ok": True, "block_ids": [1], "kv_address": "h:1"})  # a peer from before the field
    assert decode(old, PreAllocReply).hold_max_s == 0.0
    with pytest.raises(WireError):
        decode(msgspec.msgpack.encode({"migration_id": "m", "commit_in_s": -1.0}), CommitNotice)


# -- the destination registry --------------------------------------------------------------------


class Destination:
    def __init__(self, hold_max_s: float) -> None:
        self.engine = SimEngine(sim_config())
        self.ops = self.engine.migration_ops()
        self.copier = BlockCopier(self.ops.kv_regions())
        self.hold = hold_of(hold_max_s)
        self.incoming = IncomingMigrations(self.ops, self.copier, MigrationLimits(hold_max_s=hold_max_s),
                                           hold=self.hold)
        self.incoming.kv_address = "127.0.0.1:9"

    async def leased(self, mid: str, num_blocks: int = 2) -> None:
        grant = await self.incoming.handle_prealloc(PreAlloc(mid, "r", num_blocks, 2.0, 0))
        assert grant.ok and grant.hold_max_s == self.hold.hold_max_s
        payload = np.zeros(num_blocks * self.copier.block_bytes, dtype=np.uint8)
        header = FrameHeader(mid, 0, 0, num_blocks, len(payload), 0)
        await self.incoming.write(header, memoryview(payload))


@pytest.fixture
def destination():
    d = Destination(hold_max_s=1.0)
    yield d
    d.copier.close()


async def test_a_notice_for_a_migration_not_running_here_holds_nothing(destination) -> None:
    destination.incoming.handle_notice(CommitNotice("unknown", 0.0))
    mid = new_migration_id()
    await destination.leased(mid)
    destination.incoming.handle_abort(MigrationAbort(mid, "gone"))
    destination.incoming.handle_notice(CommitNotice(mid, 0.0))  # late, after its abort
    assert destination.hold.num_expected == 0


async def test_the_commit_lets_the_held_step_go_with_the_request_in_it(destination) -> None:
    mid = new_migration_id()
    await destination.leased(mid)
    destination.incoming.handle_notice(CommitNotice(mid, 0.001))
    in_engine_when_released: list[bool] = []

    async def engine_loop() -> None:
        await destination.hold.wait()
        in_engine_when_released.append(destination.engine.get_request("r") is not None)

    loop = asyncio.create_task(engine_loop())
    await asyncio.sleep(0.01)
    assert not loop.done()  # held
    commit = MigrationCommit(mid, gen("r", 4, 50), [7], num_computed_tokens=4)  # (2 blocks hold 5 tokens)
    assert (await destination.incoming.commit(commit)).ok
    await asyncio.wait_for(loop, 0.5)
    assert in_engine_when_released == [True] and destination.hold.last_held_s < 0.5


async def test_an_abort_releases_the_hold_at_once(destination) -> None:
    mid = new_migration_id()
    await destination.leased(mid)
    destination.incoming.handle_notice(CommitNotice(mid, 0.001))
    loop = asyncio.create_task(destination.hold.wait())
    await asyncio.sleep(0.01)
    destination.incoming.handle_abort(MigrationAbort(mid, "source gave up"))
    held = await asyncio.wait_for(loop, 0.5)
    assert held < 0.5 and destination.hold.num_released_at_bound == 0


def test_a_destination_without_a_hold_grants_none() -> None:
    engine = SimEngine(sim_config())
    ops = engine.migration_ops()
    copier = BlockCopier(ops.kv_regions())
    try:
        incoming = IncomingMigrations(ops, copier, MigrationLimits())
        grant = asyncio.run(incoming.handle_prealloc(PreAlloc("m", "r", 1, 2.0, 0)))
        assert grant.ok and grant.hold_max_s == 0.0
    finally:
        copier.close()


# -- pacing: a commit noticed steps ahead ----------------------------------------------------------


def test_a_commit_steps_ahead_paces_each_step_before_it_by_an_equal_share_of_the_phase_gap() -> None:
    rule = CommitHoldRule(hold_max_s=0.05, step_share=0.5)
    step = 0.040
    assert rule.paced_hold_s(2.5 * step, step) == pytest.approx(0.5 * step / 3)  # 2 whole steps, half left over
    assert rule.paced_hold_s(1.2 * step, step) == pytest.approx(0.2 * step / 2)
    assert rule.paced_hold_s(0.5 * step, step) == 0.0  # due within this step: hold or not (`holds_for`)
    assert rule.paced_hold_s(1.9 * step, step) == pytest.approx(0.9 * step / 2)  # late in a step: still paced
    assert rule.paced_hold_s(2.5 * step, 0.0) == 0.0  # no typical step yet
    assert CommitHoldRule(0.0).paced_hold_s(2.5 * step, step) == 0.0  # holds off
    assert CommitHoldRule(0.002, 0.5).paced_hold_s(1.5 * step, step) == 0.002  # within the bound


@pytest.mark.parametrize("seed", range(3))
def test_pacing_starts_the_last_step_before_a_commit_as_it_lands(seed) -> None:
    """Steps of the typical length, each held as the rule says: the step the request joins
    starts at its commit wherever it was a whole step off or more; no hold past the bound."""
    rng = np.random.default_rng(seed)
    rule = CommitHoldRule(hold_max_s=0.05, step_share=0.5)
    for _ in range(500):
        step = float(rng.uniform(0.003, 0.045))
        commit_at = float(rng.uniform(0, 4 * step))  # from a step start, the notice there
        now, holds = 0.0, []
        while True:
            due_in = commit_at - now
            if due_in < 0:  # the commit landed in the step before: the request joins this one
                waited = -due_in
                break
            if rule.holds_for(due_in, step):
                holds.append(due_in)
                waited = 0.0
                break
            held = rule.paced_hold_s(due_in, step)
            holds.append(held)
            now += held + step
        assert all(0 <= h <= rule.bound_s(step) + 1e-12 for h in holds)
        if any(holds):
            assert waited == pytest.approx(0.0, abs=1e-9)
            continue
        # Not held: due within the first step, past the bound (as the hold without notice ahead).
        assert commit_at < step and commit_at > rule.bound_s(step)
        assert waited == pytest.approx(step - commit_at)


async def test_a_paced_step_waits_its_share_and_the_commit_stays_expected() -> None:
    hold = hold_of(0.5, typical_step_s=0.040, step_share=0.5)
    hold.expect("m", 0.100, paced=True)  # 2 whole steps and 20 ms: each of 3 steps waits ~6.7 ms
    held = await hold.wait()
    assert 0.006 <= held < 0.05
    assert hold.num_paced_holds == 1 and hold.num_expected == 1 and hold.num_released_at_bound == 0


async def test_a_commit_landing_early_cuts_a_paced_hold_short() -> None:
    hold = hold_of(0.5, typical_step_s=0.040, step_share=0.5)
    hold.expect("m", 0.055, paced=True)  # one whole step and 15 ms: 7.5 ms paced now
    asyncio.get_running_loop().call_later(0.002, hold.settle, "m")  # (the source was faster than it said)
    held = await hold.wait()
    assert held < 0.006 and hold.num_expected == 0


# -- the source's notice ---------------------------------------------------------------------------


@pytest.mark.parametrize("notice_steps", [1, 3])
async def test_the_source_notices_the_commit_steps_ahead_where_the_destination_holds(make_harness,
                                                                                     notice_steps) -> None:
    h = await make_harness()
    steps = StepClock()
    h.coordinator.notices.steps = steps
    h.coordinator.notices.notice_steps = notice_steps
    h.incoming.hold = CommitHold(0.05, StepClock())  # grants say the destination holds
    notices: list[tuple[int, CommitNotice]] = []  # (the source's step in flight, the notice)
    started = 0

    async def notice(dst: str, msg: CommitNotice) -> None:
        notices.append((started, msg))
        h.incoming.handle_notice(msg)

    h.link.notice = notice
    real_step = h.src.step

    async def timed_step():  # the source's steps through its step clock, as the llumlet's loop does
        nonlocal started
        steps.started(time.monotonic())
        started += 1
        try:
            return await real_step()
        finally:
            steps.ended(time.monotonic())

    h.src.step = timed_step
    notify, due_in_step = h.coordinator.notices.notice, []

    async def in_a_step(m, check):  # the last stage comes due while a step of ours is in flight
        while steps.started_at is None:
            await asyncio.sleep(0)
        due_in_step.append(started)
        return await notify(m, check)

    h.coordinator.notices.notice = in_a_step
    await h.decoding("r", prompt=50, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert m.dst_hold_max_s == 0.05 and len(notices) == notice_steps
    # The first in the step in flight (the suspend waits for it anyway; was: one step ahead, the
    # next step's start, a step later), then one at the start of each next step, each due sooner.
    assert [step for step, _ in notices] == list(range(due_in_step[0], due_in_step[0] + notice_steps))
    due = [msg.commit_in_s for _, msg in notices]
    assert all(later < earlier for earlier, later in zip(due, due[1:])), due
    assert {msg.migration_id for _, msg in notices} == {m.migration_id}
    assert all(msg.paced == (notice_steps > 1) for _, msg in notices)
    assert due[-1] == m.notice_commit_in_s > 0
    assert m.noticed_at <= m.suspended_at  # ahead of the suspend: the lead is the step that ends in it
    assert h.incoming.hold.num_expected == 0  # the commit settled it
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_no_notice_to_a_destination_that_does_not_hold(make_harness) -> None:
    h = await make_harness()
    h.coordinator.notices.steps = StepClock()
    sent: list[CommitNotice] = []

    async def notice(dst: str, msg: CommitNotice) -> None:
        sent.append(msg)

    h.link.notice = notice
    await h.decoding("r", prompt=50, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED and m.dst_hold_max_s == 0.0 and sent == [] and m.noticed_at is None
