"""Prefill/decode hand-off (issue 19 §2), without NATS: the prefill llumlet's hand-off queue,
the scheduler's dispatch pool and hand-off answers, and the pairing that never targets a prefill
instance. The real processes run in tests/e2e/test_pd_handoff_sim.py."""

from __future__ import annotations

import asyncio

import msgspec

from services.global_scheduler.migration_loop import MigrationPairer
from services.global_scheduler.roles import NO_ROOM, UNKNOWN_SOURCE, InstanceRoles
from services.llumlet.handoff import ATTEMPTS, HandoffOutcome, PrefillHandoff, first_tokens
from services.llumlet.migration.ops import LivePhase, MigrationSnapshot
from services.llumlet.migration.outgoing import OutgoingMigration
from services.llumlet.migration.protocol import MigrationStatus
from services.llumlet.migration_hooks import LlumletMigrationHooks
from shared.engine_model.views import StepOutput
from shared.instance_table import InstanceTable
from shared.messages import (
    DispatchRequest, FinishReason, HandoffAnswer, HandoffQuery, InstanceRole, decode, encode,
)
from shared.policy.config import PolicyConfig
from shared.policy.disaggregation import account_handoff
from shared.policy.migration import DEFAULT_GUARD
from tests.unit.migration_helpers import expected_tokens, verify_kv
from tests.unit.migration_source_harness import make_harness  # noqa: F401 (a fixture)
from shared.unreported_dispatches import UnreportedDispatches
from tests.unit.policy_helpers import make_load


def role(load, r: InstanceRole):
    return msgspec.structs.replace(load, role=r, kv_address=f"127.0.0.1:{abs(hash(load.instance_id)) % 50000 + 1024}")


# -- the llumlet's side -------------------------------------------------------------------------


def test_only_a_first_token_that_goes_on_decoding_starts_a_handoff():
    outputs = [
        StepOutput("first", 0, [5]),
        StepOutput("later", 3, [6]),
        StepOutput("done-at-once", 0, [7], finish_reason=FinishReason.LENGTH),  # max_tokens 1: nothing to move
        StepOutput("chunked-prefill", 0, []),  # a prefill chunk: no token yet
    ]
    assert first_tokens(outputs) == ["first"]


class FakeSource:
    """The hand-off's view of its llumlet: a scheduler that answers, a coordinator that migrates."""

    def __init__(self, answers, statuses, phase=LivePhase.RUNNING) -> None:
        self.answers = list(answers)
        self.statuses = list(statuses)
        self.phase = phase
        self.asked: list[HandoffQuery] = []
        self.migrated: list[tuple[str, str]] = []
        self.migrated_suspended: list[bool] = []
        self.suspended: list[str] = []
        self.phases: dict[str, LivePhase] = {}  # (others: `phase`)
        self.resumed: list[str] = []

    async def ask(self, query):
        self.asked.append(query)
        return self.answers.pop(0)

    async def migrate(self, request_id, dst, suspended=False):
        self.migrated.append((request_id, dst))
        self.migrated_suspended.append(suspended)
        status = self.statuses.pop(0)
        if status is None:
            return None
        m = OutgoingMigration("mid", request_id, dst, 0, started_at=0.0)
        if status is MigrationStatus.FINISHED:
            m.finish(1.0)
        else:
            m.abort(status, "test", 1.0)
        return m

    def snapshot(self, request_id):
        phase = self.phases.get(request_id, self.phase)
        return None if phase is None else MigrationSnapshot(phase, 100, 0, 7, max_num_tokens=300)

    async def suspend(self, request_id):
        self.suspended.append(request_id)
        self.phases[request_id] = LivePhase.SUSPENDED
        return True

    async def resume(self, request_id):
        self.resumed.append(request_id)
        self.phases[request_id] = LivePhase.RUNNING

    def handoff(self, suspending: bool = False) -> PrefillHandoff:
        extra = {"suspend": self.suspend, "resume": self.resume} if suspending else {}
        handoff = PrefillHandoff("p0", self.ask, self.migrate, self.snapshot, concurrency=1, **extra)
        handoff.retry_after_s = 0.0
        return handoff


async def run_until_done(handoff: PrefillHandoff, *request_ids: str) -> None:
    await handoff.prefilled([StepOutput(request_id, 0, [5]) for request_id in request_ids])
    runner = asyncio.create_task(handoff.run())
    try:
        async with asyncio.timeout(5):
            while sum(handoff.outcomes.values()) < len(request_ids):
                await asyncio.sleep(0.01)
    finally:
        runner.cancel()


async def test_the_request_moves_to_the_destination_the_scheduler_names_then():
    source = FakeSource([HandoffAnswer(dst_instance_id="d1")], [MigrationStatus.FINISHED])
    assert await source.handoff().hand_off("r1") is HandoffOutcome.HANDED_OFF
    assert source.asked == [HandoffQuery("p0", "r1", 7, 300)]  # its blocks at hand-off time, and its length
    assert source.migrated == [("r1", "d1")]  # that request, not one the pair loop would pick


async def test_no_room_on_every_attempt_or_no_scheduler_leaves_it_decoding_here():
    source = FakeSource([HandoffAnswer(reason="no decode instance has room")] * ATTEMPTS + [None], [])
    handoff = source.handoff()
    await run_until_done(handoff, "r1")
    assert await handoff.hand_off("r2") is HandoffOutcome.NO_SCHEDULER
    assert handoff.outcomes == {HandoffOutcome.NO_ROOM: 1}
    assert [q.request_id for q in source.asked] == ["r1"] * ATTEMPTS + ["r2"]
    assert source.migrated == []


async def test_momentarily_no_room_then_handed_off():
    """A decode instance that just took a hand-off has it queued until its next step."""
    source = FakeSource([HandoffAnswer(reason="no decode instance has room"), HandoffAnswer(dst_instance_id="d1")],
                        [MigrationStatus.FINISHED])
    handoff = source.handoff()
    await run_until_done(handoff, "r1")
    assert handoff.outcomes == {HandoffOutcome.HANDED_OFF: 1} and source.migrated == [("r1", "d1")]


async def test_a_request_gone_or_preempted_is_not_asked_about():
    for phase, attempt in ((None, 1), (LivePhase.QUEUED, ATTEMPTS)):
        source = FakeSource([], [], phase=phase)
        assert await source.handoff().hand_off("r1", attempt) is HandoffOutcome.GONE
        assert source.asked == []


async def test_a_preempted_request_is_looked_at_again():
    source = FakeSource([], [], phase=LivePhase.QUEUED)
    assert await source.handoff().hand_off("r1") is None  # (queued again)


async def test_refusals_are_asked_about_again_then_it_decodes_here():
    answers = [HandoffAnswer(dst_instance_id=f"d{i}") for i in range(ATTEMPTS)]
    source = FakeSource(answers, [MigrationStatus.ABORTED_DST] * ATTEMPTS)
    handoff = source.handoff()
    await run_until_done(handoff, "r1")
    assert handoff.outcomes == {HandoffOutcome.REFUSED: 1}
    assert source.migrated == [("r1", f"d{i}") for i in range(ATTEMPTS)]  # chosen afresh each time


async def test_a_migration_the_source_aborted_is_not_retried():
    source = FakeSource([HandoffAnswer(dst_instance_id="d1")], [MigrationStatus.ABORTED_SRC])
    assert await source.handoff().hand_off("r1") is HandoffOutcome.GONE


async def test_a_handoff_that_starts_at_once_takes_the_request_out_of_the_batch_first():
    """Before the next step: it never decodes beside other prompts' prefill here."""
    source = FakeSource([HandoffAnswer(dst_instance_id="d1")] * 2, [MigrationStatus.FINISHED] * 2)
    handoff = source.handoff(suspending=True)
    await handoff.prefilled([StepOutput("r1", 0, [5]), StepOutput("r2", 0, [6])])
    assert source.suspended == ["r1"]  # one worker: r2 waits its turn decoding here
    runner = asyncio.create_task(handoff.run())
    try:
        async with asyncio.timeout(5):
            while sum(handoff.outcomes.values()) < 2:
                await asyncio.sleep(0.01)
    finally:
        runner.cancel()
    assert source.migrated == [("r1", "d1"), ("r2", "d1")] and source.migrated_suspended == [True, False]


async def test_a_suspended_request_with_nowhere_to_go_is_back_in_the_batch():
    answers = [HandoffAnswer(reason="no decode instance has room")] * ATTEMPTS
    source = FakeSource(answers, [])
    handoff = source.handoff(suspending=True)
    await run_until_done(handoff, "r1")
    assert handoff.outcomes == {HandoffOutcome.NO_ROOM: 1}
    assert source.suspended == ["r1"] and source.resumed == ["r1"] and source.phases["r1"] is LivePhase.RUNNING
    # Asked again later, decoding here meanwhile: not out of the batch again.
    assert len(source.asked) == ATTEMPTS and source.suspended == ["r1"]


async def test_a_suspended_request_the_scheduler_cannot_place_is_back_in_the_batch():
    source = FakeSource([None], [])
    handoff = source.handoff(suspending=True)
    await run_until_done(handoff, "r1")
    assert handoff.outcomes == {HandoffOutcome.NO_SCHEDULER: 1} and source.resumed == ["r1"]


def test_a_prefill_instance_refuses_incoming_migrations():
    class Llumlet:
        draining = False

    llumlet = Llumlet()
    for r, refused in ((InstanceRole.PREFILL, True), (InstanceRole.DECODE, False), (InstanceRole.MIXED, False)):
        llumlet.role = r
        assert (LlumletMigrationHooks(llumlet).refusal() is not None) == refused, r


# -- the scheduler's side -------------------------------------------------------------------------


def roles_over(*loads) -> InstanceRoles:
    table = InstanceTable(60.0)
    roles = InstanceRoles(table, DEFAULT_GUARD, PolicyConfig().headroom_blocks, UnreportedDispatches())
    for load in loads:
        table.update(load)
        roles.saw(load)
    return roles


def test_decode_instances_are_excluded_from_dispatch_while_a_prefill_instance_lives():
    p, d, m = (role(make_load("p"), InstanceRole.PREFILL), role(make_load("d"), InstanceRole.DECODE),
               role(make_load("m"), InstanceRole.MIXED))
    roles = roles_over(p, d, m)
    assert roles.disaggregated
    request = DispatchRequest("r", 10, 10, exclude=["x"])
    assert roles.restrict(request, [p, d, m]).exclude == ["x", "d"]
    draining_p = msgspec.structs.replace(p, draining=True)  # no live prefill: everyone takes requests
    assert roles.restrict(request, [draining_p, d, m]) is request


def test_a_mixed_fleet_is_not_disaggregated():
    assert not roles_over(make_load("a"), make_load("b")).disaggregated


def test_the_handoff_goes_to_the_freest_decode_instance_and_is_accounted():
    p = role(make_load("p", running={0: (1, 10)}), InstanceRole.PREFILL)
    busy = role(make_load("d-busy", running={0: (4, 60)}), InstanceRole.DECODE)
    free = role(make_load("d-free", running={0: (1, 10)}), InstanceRole.DECODE)
    roles = roles_over(p, busy, free)
    answer = roles.handoff(HandoffQuery("p", "r", 10))
    assert answer == HandoffAnswer(dst_instance_id="d-free")
    accounted = roles.table.get("d-free")
    assert (accounted.num_blocks_free, accounted.reserved_blocks, accounted.num_migrating) == (80, 10, 1)
    # The next one, answered before d-free reports again, sees those blocks taken: 75 more
    # would fit 90 free blocks with the guard's 10 % left, not 80.
    assert roles_over(p, busy, free).handoff(HandoffQuery("p", "r2", 75)).dst_instance_id == "d-free"
    assert roles.handoff(HandoffQuery("p", "r2", 75)) == HandoffAnswer(reason=NO_ROOM)


def test_no_room_on_any_decode_instance_keeps_it_on_the_prefill_instance():
    p = role(make_load("p"), InstanceRole.PREFILL)
    full = role(make_load("d", running={0: (3, 85)}), InstanceRole.DECODE)
    roles = roles_over(p, full)
    assert roles.handoff(HandoffQuery("p", "r", 10)) == HandoffAnswer(reason=NO_ROOM)
    assert roles.handoff(HandoffQuery("ghost", "r", 1)) == HandoffAnswer(reason=UNKNOWN_SOURCE)


def test_the_handoff_skips_a_decode_instance_whose_context_the_request_would_outgrow():
    p = msgspec.structs.replace(role(make_load("p"), InstanceRole.PREFILL), max_model_len=8192)
    short = msgspec.structs.replace(role(make_load("d-short"), InstanceRole.DECODE), max_model_len=1024)
    roles = roles_over(p, short)
    assert roles.handoff(HandoffQuery("p", "r", 10, max_num_tokens=4000)) == HandoffAnswer(reason=NO_ROOM)
    assert roles.handoff(HandoffQuery("p", "r", 10, max_num_tokens=1000)).dst_instance_id == "d-short"


def test_account_handoff_never_goes_below_zero_free():
    load = account_handoff(make_load("d", total=10), 50)
    assert load.num_blocks_free == 0 and load.reserved_blocks == 50


def test_handoff_messages_round_trip():
    for message in (HandoffQuery("p", "r", 3), HandoffAnswer(dst_instance_id="d"), HandoffAnswer(reason="no room")):
        assert decode(encode(message), type(message)) == message


def test_pairing_never_sends_requests_to_a_prefill_instance():
    policy = PolicyConfig(migrate_out_freeness=1.0, migrate_in_freeness=10.0)
    busy = role(make_load("busy", running={0: (10, 98)}), InstanceRole.DECODE)
    idle_prefill = role(make_load("idle-p", running={0: (1, 5)}), InstanceRole.PREFILL)
    idle_decode = role(make_load("idle-d", running={0: (1, 5)}), InstanceRole.DECODE)
    assert MigrationPairer(policy, DEFAULT_GUARD).plan([busy, idle_prefill]) == []
    orders = MigrationPairer(policy, DEFAULT_GUARD).plan([busy, idle_decode])
    assert [(o.src, o.message.dst_instance_id) for o in orders] == [("busy", "idle-d")]


# -- the coordinator's one-stage migration of a suspended request ---------------------------------


async def test_a_suspended_request_moves_in_one_stage_and_continues_its_stream(make_harness):
    h = await make_harness()
    await h.decoding("r", prompt=200, max_tokens=300, min_output=1)
    assert await h.src_ops.suspend("r")
    m = await h.coordinator.migrate("r", "dst", suspended=True)
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert [s.final for s in m.stages] == [True] and h.link.calls.count("prealloc") == 1
    assert verify_kv(h.dst, "r") and h.src.get_request("r") is None
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_a_refused_suspended_request_resumes_on_the_source(make_harness):
    h = await make_harness()
    await h.decoding("r", prompt=200, max_tokens=300, min_output=1)
    assert await h.src_ops.suspend("r")
    assert await h.coordinator.migrate("r", "dst") is None  # (not running: a suspended one says so)

    async def refuse(msg) -> None:
        h.incoming._refusal = lambda: "draining"

    h.link.before["prealloc"] = refuse
    m = await h.coordinator.migrate("r", "dst", suspended=True)
    assert m.status is MigrationStatus.ABORTED_DST
    assert h.src_ops.migration_snapshot("r").phase is LivePhase.RUNNING and h.hooks.resumes == 1
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
