"""Source coordinator under faults: each ends with the request on exactly one instance and every
block back (harness: migration_source_harness.py)."""

from __future__ import annotations

import asyncio
import contextlib

from shared.engine_model.request import RequestStatus
from services.llumlet.migration.ops import LivePhase
from services.llumlet.migration.protocol import (
    DestinationGone,
    DestinationSlow,
    MigrationLimits,
    MigrationStatus,
)
from shared.messages import PreAlloc
from tests.unit.migration_helpers import expected_tokens
from tests.unit.migration_source_harness import (
    count_adds,
    cut_the_commit_frame,
    lose_the_commit_ack,
    make_harness,
    steps_later,
)


# -- faults: each ends with the request on exactly one instance and every block back --------------


async def test_request_finishing_during_a_stage_aborts_the_migration(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=30, min_output=5)
    h.link.before["prealloc"] = steps_later(h.src, "r", 100)  # outlives the request
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_SRC and "finished" in m.reason
    assert "abort" in h.link.calls
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 30)
    assert not any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


async def test_destination_without_room_leaves_the_request_here(make_harness) -> None:
    h = await make_harness()
    filler = await h.dst_ops.reserve_blocks("someone-else", 250)  # 6 blocks left on the destination
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "no room" in m.reason
    h.dst_ops.release_reservation("someone-else")
    assert filler and h.src.get_request("r").status is RequestStatus.RUNNING  # still here
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()


async def test_destination_gone_in_the_last_stage_resumes_the_request(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=2, last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=300)

    last_stage_preallocs = 0

    async def gone_at_last_stage(msg: PreAlloc) -> None:
        nonlocal last_stage_preallocs
        if msg.stage == 1:
            last_stage_preallocs += 1
            if last_stage_preallocs == 1:  # before the suspend: let the request start new blocks
                await steps_later(h.src, "r", 8)(msg)
                return
            assert h.src_ops.migration_snapshot("r").phase is LivePhase.SUSPENDED  # its top-up
            raise DestinationGone("killed")

    h.link.before["prealloc"] = gone_at_last_stage
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and h.hooks.resumes == 1
    assert "abort" not in h.link.calls  # nobody to tell
    assert h.src_ops.migration_snapshot("r").phase is LivePhase.RUNNING
    h.incoming.stop()  # (what the lease watchdog does when nobody comes back)
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_slow_destination_gets_an_abort_and_the_request_resumes(make_harness, monkeypatch) -> None:
    """The commit's frame is cut (the destination aborts it) and the NATS COMMITs that follow go
    unanswered: the ABORT decides, and the request goes on here."""
    h = await make_harness(MigrationLimits(stage_limit=2, last_stage_blocks=0))
    cut_the_commit_frame(monkeypatch)
    await h.decoding("r", prompt=100, max_tokens=300)

    async def slow_commit(msg) -> None:
        raise DestinationSlow("no answer")

    h.link.before["commit"] = slow_commit  # (the ABORT that resolves the doubt gets through)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and h.hooks.resumes == 1
    assert m.commit_via == "frame+nats" and h.link.calls.count("commit") == h.limits.commit_attempts
    assert h.link.calls[-1] == "abort" and h.hooks.migrated_out_ids == []
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_unanswered_commit_that_did_land_counts_as_committed(make_harness) -> None:
    """The frame committed but its ack was lost, and so was the NATS COMMIT's reply: the ABORT
    is answered "already committed", so the request is released here, not resumed."""
    h = await make_harness(MigrationLimits(commit_attempts=1))
    added = count_adds(h)
    lose_the_commit_ack(h)
    await h.decoding("r", prompt=60, max_tokens=300)
    real_commit = h.link.commit

    async def commit_lost_reply(dst, msg):
        await real_commit(dst, msg)  # answered from the record, the reply is lost
        raise DestinationSlow("reply lost")

    h.link.commit = commit_lost_reply
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED and h.src.get_request("r") is None
    assert m.commit_via == "frame+nats" and h.link.calls[-1] == "abort"
    assert added == ["r"] and h.hooks.resumes == 0 and h.hooks.migrated_out_ids == ["r"]
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_commit_outcome_unknown_fails_the_request(make_harness) -> None:
    """The frame's ack is lost and the destination answers nothing over NATS either: nobody
    knows where the request runs, so it ends with an error (never resumed on a guess)."""
    h = await make_harness(MigrationLimits(commit_attempts=1, in_doubt_deadline_s=0.05, abort_timeout_s=0.01))
    lose_the_commit_ack(h)
    await h.decoding("r", prompt=60, max_tokens=300)

    async def silent(msg) -> None:
        raise DestinationSlow("partitioned")

    h.link.before["commit"] = silent
    h.link.before["abort"] = silent
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "unknown" in m.reason
    assert m.commit_via == "frame+nats" and h.hooks.resumes == 0
    assert h.hooks.failed == [("r", "migration outcome unknown")]


async def test_preemption_during_a_stage_aborts_the_migration(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=300)

    async def preempt(msg: PreAlloc) -> None:
        if msg.stage == 1:
            request = h.src.get_request("r")
            h.src.scheduler.running.remove(request)
            h.src.scheduler.block_manager.free("r")
            request.preempt(0.0)
            h.src.scheduler._push_waiting(request, front=True)

    h.link.before["prealloc"] = _chain(steps_later(h.src, "r", 4), preempt)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_SRC and "preempted" in m.reason
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


def _chain(*hooks):
    async def run(msg) -> None:
        for hook in hooks:
            await hook(msg)

    return run


async def test_client_abort_during_a_stage_ends_both_sides(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=300)

    async def client_aborts(msg: PreAlloc) -> None:
        if msg.stage == 1:
            h.src.abort_request("r")

    h.link.before["prealloc"] = _chain(steps_later(h.src, "r", 4), client_aborts)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_SRC
    h.assert_blocks_back()


async def test_stopping_the_source_resumes_and_tells_the_destination(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0, stage_limit=3))
    await h.decoding("r", prompt=100, max_tokens=400)
    hang = asyncio.Event()

    async def hang_in_last_stage(msg: PreAlloc) -> None:
        if msg.stage == 2:
            hang.set()
            await asyncio.sleep(60)

    h.link.before["prealloc"] = _chain(steps_later(h.src, "r", 4), hang_in_last_stage)
    task = asyncio.create_task(h.coordinator.migrate("r", "dst"))
    await asyncio.wait_for(hang.wait(), 5)
    await h.coordinator.stop()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    m = h.coordinator.history[-1]
    assert m.status is MigrationStatus.ABORTED_SRC and "stopping" in m.reason
    assert h.src_ops.migration_snapshot("r").phase is LivePhase.RUNNING
    assert h.dst.num_reserved_blocks() == 0  # the ABORT reached it
