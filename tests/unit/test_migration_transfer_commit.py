"""KV data plane: the COMMIT in the last frame, its outcome under faults, and wire versions."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import uuid
import zlib

import numpy as np
import pytest

from services.llumlet.migration import copier as copier_module
from services.llumlet.migration import kv_sender
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.handover import parse_commit_frames
from services.llumlet.migration.kv_sender import KVSenderPool, send_frame
from services.llumlet.migration.kv_wire import ACK_SIZE, HEADER_SIZE, AckStatus, FrameAck, FrameHeader
from services.llumlet.migration.ops import KVRegion
from services.llumlet.migration.protocol import (
    CommitOutcomeUnknown,
    DestinationRefused,
    DestinationSlow,
    MigrationLimits,
    SourceAborted,
    new_migration_id,
)
from tests.support.polling import wait_until
from tests.unit.kv_link_harness import (
    BLOCK_BYTES,
    PoolSink,
    assert_send_finds_destination_gone,
    closed_by_peer,
    make_pool,
    open_link,
    raw_connection,
    write_and_hang_up,
    wrong_crc,
)


class CommitPoolSink(PoolSink):
    """A CommitSink: commits whatever a verified frame carries, with the answer set by the test."""

    def __init__(self, copier: BlockCopier, lease: list[int]) -> None:
        super().__init__(copier, lease)
        self.commits: list[tuple[bytes, AckStatus]] = []
        self.answer: tuple[AckStatus, str] = (AckStatus.COMMITTED, "")

    async def commit_frame(self, header: FrameHeader, commit: bytes, frame_status: AckStatus):
        self.commits.append((commit, frame_status))
        return self.answer if frame_status is AckStatus.OK else (frame_status, "frame failed")


@pytest.fixture
async def commit_link(monkeypatch):
    monkeypatch.setattr(copier_module, "MIN_VIEW_BYTES", 1)
    limits = MigrationLimits(frame_bytes=4 * BLOCK_BYTES)
    async for parts in open_link(limits, lambda copier: CommitPoolSink(copier, lease=list(range(40, 64)))):
        yield parts


async def test_the_last_frame_carries_the_commit_and_its_ack_answers_it(commit_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()
    blocks = [7, 3, 19, 2, 30, 31]
    transfer = await senders.send_stage(address, mid, 0, 0, blocks, copier, commit=b"commit-bytes")
    assert transfer.committed and transfer.num_frames == 2
    assert sink.commits == [(b"commit-bytes", AckStatus.OK)]  # once, after every block was written
    np.testing.assert_array_equal(dst_pool[40:46], src_pool[blocks])
    plain = await senders.send_stage(address, mid, 1, 6, [1], copier)  # the connection goes on
    assert not plain.committed and len(sink.commits) == 1


async def test_the_commit_frame_is_timed_in_the_destinations_log_after_its_ack(commit_link, caplog) -> None:
    """Its line (header read, whole frame in) lets a benchmark split the last stage into the wire
    and the destination's commit; plain frames log nothing."""
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()
    caplog.set_level(logging.INFO, logger="services.llumlet.migration.kv_connection")
    sent = time.monotonic()
    await senders.send_stage(address, mid, 0, 0, [1, 2], copier)
    assert parse_commit_frames(caplog.text) == {}
    await senders.send_stage(address, mid, 1, 2, [3, 4, 5, 6, 8], copier, commit=b"c")  # two frames
    await wait_until(lambda: mid in parse_commit_frames(caplog.text))
    stamps = parse_commit_frames(caplog.text)[mid]
    assert sent <= stamps["frame_header_at"] <= stamps["frame_in_at"] <= time.monotonic()


async def test_a_commit_needs_no_blocks(commit_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()
    transfer = await senders.send_stage(address, mid, 0, 0, [], copier, commit=b"c")
    assert transfer.committed and transfer.num_frames == 1 and sink.commits == [(b"c", AckStatus.OK)]


async def test_a_refused_commit_is_a_refusal_with_its_reason(commit_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()
    sink.answer = (AckStatus.COMMIT_REFUSED, "KV incomplete: 1 of 2 blocks written")
    with pytest.raises(DestinationRefused, match="commit refused.*KV incomplete"):
        await senders.send_stage(address, mid, 0, 0, [1], copier, commit=b"c")
    await senders.send_stage(address, mid, 1, 1, [2], copier)  # the connection goes on


async def test_a_commit_in_a_corrupt_frame_is_refused(commit_link, monkeypatch) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()

    monkeypatch.setattr(senders, "checksum", wrong_crc)
    with pytest.raises(DestinationRefused, match="BAD_CHECKSUM"):
        await senders.send_stage(address, mid, 0, 0, [1, 2], copier, commit=b"c")
    assert sink.failed == [AckStatus.BAD_CHECKSUM] and sink.commits == [(b"c", AckStatus.BAD_CHECKSUM)]
    assert not dst_pool.any()


async def test_a_corrupt_commit_section_fails_the_frame(commit_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()
    payload, commit = src_pool[[1]].tobytes(), b"commit"
    reader, writer = await raw_connection(address)
    writer.write(FrameHeader(mid, 0, 0, 1, len(payload), commit_len=len(commit)).pack() + payload
                 + zlib.crc32(payload).to_bytes(4, "big") + commit + (zlib.crc32(commit) ^ 1).to_bytes(4, "big"))
    await writer.drain()
    raw = await asyncio.wait_for(reader.readexactly(ACK_SIZE), 2.0)
    _, detail_len = FrameAck.unpack_fixed(raw)
    raw += await asyncio.wait_for(reader.readexactly(detail_len), 2.0)
    writer.close()
    assert FrameAck.unpack(raw).status is AckStatus.BAD_CHECKSUM
    assert sink.failed == [AckStatus.BAD_CHECKSUM] and sink.filled == 0 and not dst_pool.any()


async def test_connection_lost_after_the_commit_went_out_leaves_the_outcome_unknown(commit_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()

    async def commit_then_vanish(header, commit, frame_status):
        sink.commits.append((commit, frame_status))
        receiver.drop_connections()  # committed, but the ack never leaves
        return AckStatus.COMMITTED, ""

    sink.commit_frame = commit_then_vanish
    with pytest.raises(CommitOutcomeUnknown):
        await senders.send_stage(address, mid, 0, 0, [1, 2], copier, commit=b"c")
    assert len(sink.commits) == 1


async def test_a_stage_stopped_before_the_commit_went_out_is_not_in_doubt(commit_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()
    calls = 0

    def between_frames() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise SourceAborted("request finished")  # stops before the commit's frame

    with pytest.raises(SourceAborted):
        await senders.send_stage(address, mid, 0, 0, list(range(8)), copier, between_frames, commit=b"c")
    assert sink.commits == []


async def test_a_commit_frame_cut_in_its_commit_section_never_commits(commit_link) -> None:
    """The sender hangs up after the payload, mid-commit: the migration fails (TRUNCATED) and the
    sink is never asked to commit."""
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    sink.migration_id = mid = new_migration_id()
    payload, commit = src_pool[[1]].tobytes(), b"commit"
    await write_and_hang_up(address, FrameHeader(mid, 0, 0, 1, len(payload), commit_len=len(commit)).pack()
                            + payload + zlib.crc32(payload).to_bytes(4, "big") + commit[:3])
    await wait_until(lambda: sink.failed == [AckStatus.TRUNCATED])
    assert sink.commits == []


async def silent_receiver() -> tuple[asyncio.Server, str]:
    """A receiver that takes every byte and never acks (a destination stuck mid-stage)."""

    async def swallow(reader, writer) -> None:
        while await reader.read(1 << 16):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("commit", [b"", b"c"])
async def test_an_unanswered_stage_is_slow_and_an_unanswered_commit_is_in_doubt(commit: bytes) -> None:
    server, address = await silent_receiver()
    copier = BlockCopier([KVRegion(make_pool(4, 0))])
    senders = KVSenderPool(MigrationLimits(stage_timeout_base_s=0.2))
    expected = CommitOutcomeUnknown if commit else DestinationSlow
    with pytest.raises(expected):
        await senders.send_stage(address, new_migration_id(), 0, 0, [1, 2], copier, commit=commit)
    assert not senders.connection(address).connected  # its framing state is unknown: closed
    senders.close()
    copier.close()
    server.close()
    await server.wait_closed()


async def test_a_peer_of_another_version_fails_the_stage_cleanly(commit_link) -> None:
    """A v2 sender's frame closes the connection (the v2 receiver likewise refuses ours: the
    sender sees the connection closed and the migration ends with DestinationGone)."""
    src_pool, copier, senders, dst_pool, sink, address, receiver = commit_link
    mid = new_migration_id()
    head = struct.pack("!4sHH16sIIIQ", b"CKV2", 2, 0, uuid.UUID(hex=mid).bytes, 0, 0, 1, BLOCK_BYTES)
    reader, writer = await raw_connection(address)
    writer.write(head + zlib.crc32(head).to_bytes(4, "big") + src_pool[1].tobytes() + b"\x00" * 4)
    await writer.drain()
    assert await closed_by_peer(reader)
    writer.close()
    assert sink.failed == [] and not dst_pool.any()


async def test_a_receiver_that_hangs_up_on_our_version_is_destination_gone() -> None:
    async def hang_up(reader, writer) -> None:
        await reader.read(HEADER_SIZE)
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    await assert_send_finds_destination_gone(address)
    server.close()
    await server.wait_closed()


class _BottomlessSocket:
    """A socket whose buffer never fills: sendmsg takes everything, so a send never waits."""

    def __init__(self) -> None:
        self.sent = 0

    def sendmsg(self, views) -> int:
        sent = sum(view.nbytes for view in views)
        self.sent += sent
        return sent


async def test_a_long_send_lets_the_event_loop_run_other_work() -> None:
    """Even when the socket never blocks, the sender yields every SEND_YIELD_BYTES: the source's
    other work (its engine's outputs, a simulated engine's steps) is not held up for a stage."""
    payload = np.zeros(32 << 20, dtype=np.uint8)
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def crc(piece: list[memoryview]) -> int:
        return 0

    ticker = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    before, sock = ticks, _BottomlessSocket()
    header = FrameHeader(str(uuid.uuid4()), 0, 0, 1, payload.nbytes)
    await send_frame(asyncio.get_running_loop(), sock, header, [memoryview(payload)], crc)
    ticker.cancel()
    assert sock.sent > payload.nbytes
    assert ticks - before >= payload.nbytes // kv_sender.SEND_YIELD_BYTES - 1
