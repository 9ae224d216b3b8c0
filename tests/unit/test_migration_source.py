"""Source coordinator: the multi-stage protocol's normal path, and pairs and the migrate-out loop
(harness: migration_source_harness.py; faults and the commit path in the files beside)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.llumlet.migration.ops import LivePhase
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from services.llumlet.migration.outgoing import OutgoingMigration
from services.llumlet.migration.source import MigrationCoordinator
from shared.messages import MigrateOrder, PreAlloc
from tests.unit.migration_helpers import BLOCK_SIZE, KV_BYTES_PER_TOKEN, FakeClock, expected_tokens, gen, verify_kv
from tests.unit.migration_source_harness import Hooks, make_harness, steps_later


# -- the normal path ---------------------------------------------------------------------------


@pytest.mark.parametrize("whole_blocks,token_frames", [(False, True), (True, True), (False, False)],
                         ids=["token-slots", "layout-without-slots", "token-frames-off"])
async def test_a_decoding_request_moves_and_continues_the_same_stream(make_harness, whole_blocks,
                                                                      token_frames) -> None:
    h = await make_harness(MigrationLimits(token_frames=token_frames), whole_blocks=whole_blocks)
    whole_blocks = whole_blocks or not token_frames
    await h.decoding("r", prompt=50, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert verify_kv(h.dst, "r") and h.src.get_request("r") is None
    assert h.hooks.migrated_out_ids == ["r"]
    assert m.stages[-1].final and not any(s.final for s in m.stages[:-1])
    assert sum(s.num_blocks for s in m.stages) == m.blocks_sent == m.lease_blocks
    sent = sum(s.num_bytes for s in m.stages) // KV_BYTES_PER_TOKEN
    if whole_blocks:  # every block whole, the partial last one included
        assert sent == m.lease_blocks * BLOCK_SIZE and not any(s.num_tokens for s in m.stages)
    else:  # each computed token once, none past them: the last stage only what was computed since
        assert sent == m.tokens_sent and any(s.num_tokens for s in m.stages)
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    assert any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


async def test_stages_shrink_while_the_request_keeps_decoding(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0, stage_limit=10))
    await h.decoding("r", prompt=200, max_tokens=600)
    h.link.before["prealloc"] = steps_later(h.src, "r", 4)  # one block of new tokens per stage
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert len(m.stages) >= 3
    sizes = [s.num_blocks for s in m.stages]
    assert sizes[0] >= 50 and all(n <= 3 for n in sizes[1:-1]), sizes
    # The forced last stage also carries what was decoded while its PRE-ALLOC went out (before
    # the suspend), plus the partial block: one stage's worth more at most.
    assert m.stages[-1].final and sizes[-1] <= 6, sizes
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 600)


async def test_the_stage_limit_forces_the_last_stage(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0, stage_limit=3))
    await h.decoding("r", prompt=100, max_tokens=600)
    h.link.before["prealloc"] = steps_later(h.src, "r", 8)  # always new blocks: never converges
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert [s.final for s in m.stages] == [False, False, True]
    assert h.link.calls.count("prealloc") == 4  # the last stage's before the suspend, and a top-up
    assert m.stages[-1].prealloc_s > 0
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 600)


async def test_a_blocking_copy_reserves_before_the_suspend(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=1))
    await h.decoding("r", prompt=100, max_tokens=200)
    assert h.src_ops.migration_snapshot("r").max_num_tokens == 300  # what a hand-off's destination must hold
    phases = []

    async def record_phase(msg: PreAlloc) -> None:
        phases.append(h.src_ops.migration_snapshot("r").phase)

    h.link.before["prealloc"] = record_phase
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert phases[0] is LivePhase.RUNNING  # the reservation is off the downtime
    assert m.stages[-1].prealloc_s == 0.0 or phases[1:] == [LivePhase.SUSPENDED]  # (a top-up, if it grew)
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()


async def test_stage_limit_one_is_a_blocking_copy(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=1))
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED
    assert len(m.stages) == 1 and m.stages[0].final and m.stages[0].num_blocks == m.blocks_sent
    assert m.downtime_s is not None and m.downtime_s > 0
    await h.wait_finished("r")
    h.assert_blocks_back()


async def test_an_engine_without_kv_bytes_still_runs_the_whole_protocol(make_harness) -> None:
    h = await make_harness(kv_bytes_per_token=0)
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED and sum(s.num_bytes for s in m.stages) == 0
    assert m.blocks_sent == m.lease_blocks > 0
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()



# -- pairs and the migrate-out loop ----------------------------------------------------------------


def test_orders_are_idempotent_and_lapse_without_confirmation() -> None:
    clock = FakeClock()
    c = MigrationCoordinator("me", None, None, None, None, MigrationLimits(pair_ttl_s=1.0), Hooks(), clock=clock)
    c.on_order(MigrateOrder("p1", "dst-a"))
    clock.advance(0.8)
    c.on_order(MigrateOrder("p1", "dst-a"))  # re-confirmed
    clock.advance(0.8)
    assert c.current_destination() == "dst-a"
    clock.advance(0.3)
    assert c.current_destination() is None  # lapsed: the scheduler stopped confirming
    c.on_order(MigrateOrder("p2", "dst-b"))
    c.on_order(MigrateOrder("p1", "dst-a", cancel=True))  # an old pair's cancel changes nothing
    assert c.current_destination() == "dst-b"
    c.on_order(MigrateOrder("p2", "dst-b", cancel=True))
    assert c.current_destination() is None
    c.on_order(MigrateOrder("p3", "me"))
    assert c.current_destination() is None


async def test_the_loop_migrates_lowest_priority_then_shortest_until_cancelled(make_harness) -> None:
    h = await make_harness(MigrationLimits(min_residence_s=0))  # (the guard has its own tests)
    h.src.add_request(gen("long-normal", 300, 2000))
    h.src.add_request(gen("short-normal", 80, 2000))
    h.src.add_request(gen("short-high", 40, 2000, priority=-1))
    async with asyncio.timeout(5):
        while len(h.src_ops.migration_candidates()) < 3:
            await asyncio.sleep(0.001)
    loop = asyncio.create_task(h.coordinator.run())
    try:
        h.coordinator.on_order(MigrateOrder("p", "dst"))
        async with asyncio.timeout(10):
            while len(h.coordinator.history) < 2:
                await asyncio.sleep(0.002)
        h.coordinator.on_order(MigrateOrder("p", "dst", cancel=True))
        await asyncio.sleep(0.05)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    moved = [m.request_id for m in h.coordinator.history]
    assert moved[:2] == ["short-normal", "long-normal"]
    assert "short-high" not in moved[:2]
    assert all(m.status is MigrationStatus.FINISHED for m in h.coordinator.history)
    assert h.coordinator.num_active == 0


def test_migration_transitions_assert_the_starting_state() -> None:
    m = OutgoingMigration("m", "r", "dst", 0)
    m.finish(1.0)
    with pytest.raises(AssertionError):
        m.abort(MigrationStatus.ABORTED_DST, "late", 2.0)
    with pytest.raises(AssertionError):
        m.finish(2.0)
    with pytest.raises(AssertionError):
        OutgoingMigration("m", "r", "dst", 0).abort(MigrationStatus.FINISHED, "not an abort", 0.0)
