"""Source coordinator: the COMMIT in the last KV frame (the default) and its NATS fallback
(harness: migration_source_harness.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from shared.engine_model.views import EngineError
from services.llumlet.migration.ops import LivePhase
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from tests.unit.migration_helpers import expected_tokens
from tests.unit.migration_source_harness import count_adds, cut_the_commit_frame, lose_the_commit_ack, make_harness


# -- the COMMIT in the last KV frame (the default) and its NATS fallback --------------------------


async def test_the_commit_rides_in_the_last_frame_and_its_ack_ends_the_downtime(make_harness) -> None:
    h = await make_harness()
    added = count_adds(h)
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert m.commit_via == "frame" and "commit" not in h.link.calls  # no NATS COMMIT at all
    assert h.link.calls[-1] == "prealloc"  # the last stage's, before the suspend
    assert m.stages[-1].final and m.stages[-1].prealloc_s == 0.0
    assert m.downtime_s == pytest.approx(m.committed_at - m.suspended_at) and m.commit_s > 0
    assert added == ["r"] and h.hooks.migrated_out_ids == ["r"]
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_a_blocking_copy_carries_the_commit_too(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=1, frame_bytes=1024))  # a stage of many frames
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED and m.commit_via == "frame"
    assert len(m.stages) == 1 and m.stages[0].num_blocks == m.blocks_sent
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()


async def test_a_commit_refused_in_the_frame_resumes_the_request_here(make_harness) -> None:
    h = await make_harness()

    def refuse(commit, lease_id):
        raise EngineError("does not fit")

    h.dst_ops.add_migrated = refuse
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "commit refused" in m.reason and "does not fit" in m.reason
    assert h.hooks.resumes == 1 and h.hooks.migrated_out_ids == [] and "commit" not in h.link.calls
    assert h.src_ops.migration_snapshot("r").phase is LivePhase.RUNNING
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    assert not any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


async def test_ack_lost_after_the_frame_committed_is_resolved_once_over_nats(make_harness) -> None:
    h = await make_harness()
    added = count_adds(h)
    lose_the_commit_ack(h)
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert m.commit_via == "frame+nats" and h.link.calls.count("commit") == 1  # answered from the record
    assert added == ["r"] and h.hooks.migrated_out_ids == ["r"] and h.hooks.resumes == 0
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_connection_lost_before_the_commit_landed_resumes_the_request_once(make_harness, monkeypatch) -> None:
    h = await make_harness()
    added = count_adds(h)
    cut_the_commit_frame(monkeypatch)  # the header only: the destination aborts the migration (TRUNCATED)
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "commit refused" in m.reason, m.reason
    assert m.commit_via == "frame+nats" and h.link.calls.count("commit") == 1
    assert added == [] and h.hooks.resumes == 1 and h.hooks.migrated_out_ids == []
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    assert not any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


async def test_stopping_while_the_commit_is_in_flight_asks_before_resuming(make_harness) -> None:
    """Cancelled after the frame went out: the ABORT decides; the destination had committed,
    so the request is released here, not resumed (it must not run twice)."""
    h = await make_harness()
    added = count_adds(h)
    real_commit_frame = h.incoming.commit_frame
    committed = asyncio.Event()

    async def commit_then_hang(header, raw, frame_status):
        answer = await real_commit_frame(header, raw, frame_status)
        committed.set()
        await asyncio.sleep(60)  # the ack is late
        return answer

    h.incoming.commit_frame = commit_then_hang
    await h.decoding("r", prompt=60, max_tokens=300)
    task = asyncio.create_task(h.coordinator.migrate("r", "dst"))
    await asyncio.wait_for(committed.wait(), 5)
    await h.coordinator.stop()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    m = h.coordinator.history[-1]
    assert m.status is MigrationStatus.FINISHED and h.link.calls[-1] == "abort"
    assert added == ["r"] and h.hooks.resumes == 0 and h.src.get_request("r") is None
    h.receiver.drop_connections()
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
