"""KV data plane: a real loopback receiver/sender pair (no NATS); faults on the wire. (The wire
format alone: test_migration_transfer_wire.py.)"""

from __future__ import annotations

import asyncio
import socket
import struct
import uuid
import zlib

import numpy as np
import pytest

from services.llumlet.migration import copier as copier_module
from services.llumlet.migration import kv_connection, kv_sender
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_sender import KVSenderPool, send_frame
from services.llumlet.migration.kv_wire import (
    ACK_SIZE,
    HEADER_SIZE,
    TRAILER_SIZE,
    AckStatus,
    FrameAck,
    FrameHeader,
    parse_address,
)
from services.llumlet.migration.ops import KVRegion
from services.llumlet.migration.protocol import (
    CommitOutcomeUnknown,
    DestinationGone,
    DestinationRefused,
    DestinationSlow,
    MigrationLimits,
    SourceAborted,
    new_migration_id,
)

BLOCK_BYTES = 256


class PoolSink:
    """A FrameSink over one numpy pool: every frame of `migration_id` goes to `lease` blocks."""

    def __init__(self, copier: BlockCopier, lease: list[int]) -> None:
        self.copier = copier
        self.lease = lease
        self.migration_id = ""
        self.filled = 0
        self.failed: list[AckStatus] = []

    def admit(self, header: FrameHeader) -> AckStatus:
        if header.migration_id != self.migration_id:
            return AckStatus.UNKNOWN_MIGRATION
        if header.lease_offset != self.filled:
            return AckStatus.BAD_RANGE
        return AckStatus.OK

    async def write(self, header: FrameHeader, payload: memoryview) -> AckStatus:
        start = header.lease_offset
        await self.copier.scatter(self.lease[start : start + header.num_blocks], payload)
        self.filled += header.num_blocks
        return AckStatus.OK

    def frame_failed(self, header: FrameHeader, status: AckStatus) -> None:
        self.failed.append(status)


async def wrong_crc(piece: list[memoryview]) -> int:
    """A sender checksum that never matches: the frame must be refused as corrupt."""
    return zlib.crc32(b"".join(piece)) ^ 1


def make_pool(num_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_blocks, BLOCK_BYTES), dtype=np.uint8)


@pytest.fixture(params=["views", "gather"])
async def link(request, monkeypatch):
    """(source pool, its copier, sender pool, destination pool, sink, receiver address), the
    source sending from views of its blocks or from gathered copies."""
    monkeypatch.setattr(copier_module, "MIN_VIEW_BYTES", 1 if request.param == "views" else 1 << 30)
    limits = MigrationLimits(frame_bytes=4 * BLOCK_BYTES)  # small frames: a stage spans several
    async for parts in open_link(limits, lambda copier: PoolSink(copier, lease=list(range(40, 64)))):
        yield parts


async def open_link(limits: MigrationLimits, make_sink):
    """Source pool and copier, sender pool, destination pool, sink and receiver over loopback."""
    src_pool, dst_pool = make_pool(64, 1), np.zeros((64, BLOCK_BYTES), dtype=np.uint8)
    src_copier, dst_copier = BlockCopier([KVRegion(src_pool)]), BlockCopier([KVRegion(dst_pool)])
    sink = make_sink(dst_copier)
    receiver = KVReceiver(sink, limits, dst_copier.new_host_buffer)
    address = await receiver.start()
    senders = KVSenderPool(limits)
    yield src_pool, src_copier, senders, dst_pool, sink, address, receiver
    senders.close()
    await receiver.close()
    src_copier.close()
    dst_copier.close()


async def test_stages_land_in_the_lease_blocks_over_one_connection(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()
    blocks = [7, 3, 19, 2, 30, 31, 11, 5, 8, 1]
    first = await senders.send_stage(address, mid, 0, 0, blocks[:9], copier)
    second = await senders.send_stage(address, mid, 1, 9, blocks[9:], copier)
    assert (first.num_frames, second.num_frames) == (3, 1)
    assert first.num_bytes == 9 * BLOCK_BYTES
    np.testing.assert_array_equal(dst_pool[40:50], src_pool[blocks])
    assert len(receiver._connections) == 1  # reused across stages
    assert sink.failed == []


async def test_corrupt_payload_is_refused_and_reported(link, monkeypatch) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()

    monkeypatch.setattr(senders, "checksum", wrong_crc)
    with pytest.raises(DestinationRefused, match="BAD_CHECKSUM"):
        await senders.send_stage(address, mid, 0, 0, [1, 2, 3], copier)
    assert sink.failed == [AckStatus.BAD_CHECKSUM]  # the destination aborts that migration


async def test_unknown_migration_is_refused(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = new_migration_id()
    with pytest.raises(DestinationRefused, match="UNKNOWN_MIGRATION"):
        await senders.send_stage(address, new_migration_id(), 0, 0, [1], copier)
    # The connection stays usable for the next (valid) stage.
    await senders.send_stage(address, sink.migration_id, 0, 0, [4], copier)
    np.testing.assert_array_equal(dst_pool[40], src_pool[4])


async def raw_connection(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = parse_address(address)
    return await asyncio.open_connection(host, port)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 2.0) == b""
    except ConnectionResetError:  # closed with our bytes still unread
        return True


async def wait_until(predicate, timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


async def write_and_hang_up(address: str, data: bytes) -> None:
    """A sender that dies after writing `data` (a frame cut short somewhere)."""
    _, writer = await raw_connection(address)
    writer.write(data)
    await writer.drain()
    writer.close()


async def test_truncated_frame_fails_its_migration(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()
    payload = src_pool[[1, 2]].tobytes()
    await write_and_hang_up(address, FrameHeader(mid, 0, 0, 2, len(payload)).pack() + payload[:300])
    await wait_until(lambda: sink.failed == [AckStatus.TRUNCATED])
    assert sink.filled == 0 and not dst_pool.any()


async def test_frame_cut_in_its_trailer_fails_its_migration(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()
    payload = src_pool[[1, 2]].tobytes()
    trailer = zlib.crc32(payload).to_bytes(4, "big")
    await write_and_hang_up(address, FrameHeader(mid, 0, 0, 2, len(payload)).pack() + payload + trailer[:2])
    await wait_until(lambda: sink.failed == [AckStatus.TRUNCATED])
    assert sink.filled == 0 and not dst_pool.any()


async def send_raw_frame(address: str, header: FrameHeader, payload: bytes, crc: int) -> FrameAck:
    """One hand-made frame (header, payload, trailer); the receiver's ack."""
    reader, writer = await raw_connection(address)
    writer.write(header.pack() + payload + crc.to_bytes(TRAILER_SIZE, "big"))
    await writer.drain()
    ack = FrameAck.unpack(await asyncio.wait_for(reader.readexactly(ACK_SIZE), 2.0))
    writer.close()
    return ack


async def test_frame_made_by_the_spec_is_accepted(link) -> None:
    """The wire format as the module doc states it: header, payload, big-endian crc32 trailer."""
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()
    payload = src_pool[[5, 6]].tobytes()
    ack = await send_raw_frame(address, FrameHeader(mid, 0, 0, 2, len(payload)), payload, zlib.crc32(payload))
    assert ack == FrameAck(AckStatus.OK, mid, 0, 0)
    np.testing.assert_array_equal(dst_pool[40:42], src_pool[[5, 6]])


async def test_payload_corrupted_on_the_wire_is_never_written(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()
    payload = bytearray(src_pool[[5, 6]].tobytes())
    crc = zlib.crc32(payload)
    payload[300] ^= 0x40  # one bit flipped after the sender's checksum
    ack = await send_raw_frame(address, FrameHeader(mid, 0, 0, 2, len(payload)), bytes(payload), crc)
    assert ack.status is AckStatus.BAD_CHECKSUM
    await wait_until(lambda: sink.failed == [AckStatus.BAD_CHECKSUM])
    assert sink.filled == 0 and not dst_pool.any()  # the corrupt bytes never reached a block


async def test_garbage_header_closes_the_connection(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    reader, writer = await raw_connection(address)
    writer.write(b"GET / HTTP/1.1\r\n" + b"x" * HEADER_SIZE)
    await writer.drain()
    assert await closed_by_peer(reader)
    writer.close()
    assert sink.failed == []


async def test_oversized_frame_closes_the_connection(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    reader, writer = await raw_connection(address)
    writer.write(FrameHeader(new_migration_id(), 0, 0, 1, receiver.limits.max_frame_bytes + 1, 0).pack())
    await writer.drain()
    assert await closed_by_peer(reader)
    writer.close()


async def assert_send_finds_destination_gone(address: str) -> None:
    copier = BlockCopier([KVRegion(make_pool(4, 0))])
    senders = KVSenderPool(MigrationLimits())
    with pytest.raises(DestinationGone):
        await senders.send_stage(address, new_migration_id(), 0, 0, [1], copier)
    senders.close()
    copier.close()


async def test_receiver_gone_is_destination_gone() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % sock.getsockname()[1]  # bound, never listening: refused
    await assert_send_finds_destination_gone(address)


async def test_bandwidth_cap_paces_frames(link) -> None:
    src_pool, copier, _, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()
    rate = 40 * BLOCK_BYTES  # bytes per second
    senders = KVSenderPool(MigrationLimits(bandwidth_bytes_per_s=rate, throttle_frame_s=0.05))
    loop = asyncio.get_running_loop()
    started = loop.time()
    transfer = await senders.send_stage(address, mid, 0, 0, list(range(12)), copier)  # 12 frames of 2 blocks
    elapsed = loop.time() - started
    senders.close()
    assert transfer.num_frames == 6
    assert elapsed >= 10 * BLOCK_BYTES / rate * 0.9  # the 6th frame waits for the first 5 to "drain"
    np.testing.assert_array_equal(dst_pool[40:52], src_pool[:12])


async def test_a_slow_scatter_pauses_the_receiver_without_losing_frames(link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    sink.migration_id = mid = new_migration_id()
    real_write = sink.write

    async def slow_write(header, payload):
        await asyncio.sleep(0.01)
        return await real_write(header, payload)

    sink.write = slow_write
    blocks = list(range(24))
    transfer = await senders.send_stage(address, mid, 0, 0, blocks, copier)  # 6 frames, 2 buffers
    assert transfer.num_frames == 6 and sink.failed == []
    np.testing.assert_array_equal(dst_pool[40:64], src_pool[blocks])
    (connection,) = receiver._connections
    assert len(connection._buffers) == 2  # back-pressure, not more memory


# -- checksums and vectored sends -----------------------------------------------------------------


def test_pieces_cut_views_without_losing_bytes() -> None:
    views = [memoryview(bytes(range(i, i + n))) for i, n in ((0, 5), (50, 12), (100, 1))]
    pieces = list(kv_sender._pieces(views, 7))
    assert [sum(v.nbytes for v in piece) for piece in pieces] == [7, 7, 4]
    assert b"".join(b"".join(piece) for piece in pieces) == b"".join(views)


async def test_frames_go_out_in_many_pieces_and_partial_sends(link, monkeypatch) -> None:
    """Pieces not aligned to blocks and few vectors per sendmsg: the bytes and crc still match."""
    src_pool, copier, senders, dst_pool, sink, address, receiver = link
    monkeypatch.setattr(kv_connection, "PIECE_BYTES", 300)  # receiver
    monkeypatch.setattr(kv_sender, "SEND_PIECE_BYTES", 300)  # sender
    monkeypatch.setattr(kv_sender, "_IOV_MAX", 3)
    sink.migration_id = mid = new_migration_id()
    blocks = [9, 2, 3, 4, 17, 30, 1]
    transfer = await senders.send_stage(address, mid, 0, 0, blocks, copier)
    assert transfer.num_frames == 2 and sink.failed == []
    np.testing.assert_array_equal(dst_pool[40:47], src_pool[blocks])


# -- receiving straight into lent blocks ----------------------------------------------------------


class LendingSink(PoolSink):
    """A DirectFrameSink: lends views of the lease blocks; records every close."""

    def __init__(self, copier: BlockCopier, lease: list[int]) -> None:
        super().__init__(copier, lease)
        self.closed: list[bool] = []
        self.open = 0  # frames whose blocks are lent right now

    def open_frame(self, header: FrameHeader):
        status = self.admit(header)
        if status is not AckStatus.OK:
            return status
        self.open += 1
        start = header.lease_offset
        return self.copier.block_views(self.lease[start : start + header.num_blocks])

    def close_frame(self, header: FrameHeader, ok: bool) -> AckStatus:
        self.open -= 1
        self.closed.append(ok)
        if ok:
            self.filled += header.num_blocks
        return AckStatus.OK


@pytest.fixture
async def lending_link(monkeypatch):
    monkeypatch.setattr(copier_module, "MIN_VIEW_BYTES", 1)
    limits = MigrationLimits(frame_bytes=4 * BLOCK_BYTES, lease_s=0.3)
    lease = [50, 51, 52, 40, 41, 42, 43, 44, 60, 61, 62, 63]
    async for parts in open_link(limits, lambda copier: LendingSink(copier, lease=lease)):
        yield parts


async def test_lent_blocks_receive_the_payload_without_staging(lending_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = lending_link
    sink.migration_id = mid = new_migration_id()
    blocks = [7, 3, 19, 2, 30, 31, 11, 5, 8, 1]
    transfer = await senders.send_stage(address, mid, 0, 0, blocks, copier)
    assert transfer.num_frames == 3 and sink.failed == []
    assert sink.closed == [True, True, True] and sink.open == 0
    np.testing.assert_array_equal(dst_pool[sink.lease[:10]], src_pool[blocks])
    (connection,) = receiver._connections
    assert connection._buffers == []  # no staging buffer, no scatter


async def test_receiver_wakes_for_large_reads_but_never_past_what_the_frame_owes(lending_link, monkeypatch) -> None:
    """SO_RCVLOWAT goes up while a payload streams in and comes down as the frame's end nears
    (a mark the sender never reaches would stall it), back to 1 between frames."""
    monkeypatch.setattr(kv_connection, "RCVLOWAT_BYTES", 3 * BLOCK_BYTES + 100)  # above a frame's tail
    marks: list[int] = []
    real_wake_after = kv_connection.FrameConnection._wake_after

    def wake_after(self, payload_left: int) -> None:
        real_wake_after(self, payload_left)
        marks.append(self._lowat)

    monkeypatch.setattr(kv_connection.FrameConnection, "_wake_after", wake_after)
    src_pool, copier, senders, dst_pool, sink, address, receiver = lending_link
    sink.migration_id = mid = new_migration_id()
    blocks = [7, 3, 19, 2, 30, 31, 11, 5, 8, 1]  # frames of 4, 4 and 2 blocks
    await asyncio.wait_for(senders.send_stage(address, mid, 0, 0, blocks, copier), 5)
    np.testing.assert_array_equal(dst_pool[sink.lease[:10]], src_pool[blocks])
    assert 3 * BLOCK_BYTES + 100 in marks and 2 * BLOCK_BYTES in marks  # raised; the short last frame
    (connection,) = receiver._connections
    assert connection._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1 == marks[-1]


async def test_corrupt_payload_in_lent_blocks_is_never_counted(lending_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = lending_link
    sink.migration_id = mid = new_migration_id()
    payload = bytearray(src_pool[[5, 6]].tobytes())
    crc = zlib.crc32(payload)
    payload[3] ^= 0x01
    ack = await send_raw_frame(address, FrameHeader(mid, 0, 0, 2, len(payload)), bytes(payload), crc)
    assert ack.status is AckStatus.BAD_CHECKSUM
    await wait_until(lambda: sink.failed == [AckStatus.BAD_CHECKSUM])
    assert sink.closed == [False] and sink.open == 0 and sink.filled == 0


async def test_truncated_payload_in_lent_blocks_gives_them_back(lending_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = lending_link
    sink.migration_id = mid = new_migration_id()
    payload = src_pool[[1, 2]].tobytes()
    await write_and_hang_up(address, FrameHeader(mid, 0, 0, 2, len(payload)).pack() + payload[:300])
    await wait_until(lambda: sink.failed == [AckStatus.TRUNCATED])
    assert sink.closed == [False] and sink.open == 0 and sink.filled == 0


async def test_sender_stalled_mid_frame_loses_the_connection(lending_link) -> None:
    """Lent blocks are pinned while their frame is open: a sender that stops sending for a lease
    period (0.3 s here) is cut off, and the blocks go back."""
    src_pool, copier, senders, dst_pool, sink, address, receiver = lending_link
    sink.migration_id = mid = new_migration_id()
    payload = src_pool[[1, 2]].tobytes()
    reader, writer = await raw_connection(address)
    writer.write(FrameHeader(mid, 0, 0, 2, len(payload)).pack() + payload[:300])
    await writer.drain()
    assert await closed_by_peer(reader)  # without us closing anything
    writer.close()
    assert sink.failed == [AckStatus.TRUNCATED] and sink.closed == [False] and sink.open == 0


async def test_refused_lent_frame_is_skipped_and_the_connection_goes_on(lending_link) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = lending_link
    sink.migration_id = new_migration_id()
    with pytest.raises(DestinationRefused, match="UNKNOWN_MIGRATION"):
        await senders.send_stage(address, new_migration_id(), 0, 0, [1, 2], copier)
    await senders.send_stage(address, sink.migration_id, 0, 0, [4], copier)
    np.testing.assert_array_equal(dst_pool[sink.lease[0]], src_pool[4])
    assert sink.closed == [True]


async def test_a_sink_may_decline_to_lend_for_one_frame(lending_link, monkeypatch) -> None:
    src_pool, copier, senders, dst_pool, sink, address, receiver = lending_link
    sink.migration_id = mid = new_migration_id()
    monkeypatch.setattr(sink, "open_frame", lambda header: None)  # e.g. pieces too small
    await senders.send_stage(address, mid, 0, 0, [6, 7], copier)
    np.testing.assert_array_equal(dst_pool[sink.lease[:2]], src_pool[[6, 7]])
    assert sink.closed == [] and sink.failed == []  # written by the staged path (write)


# -- the COMMIT in the last frame, wire versions --------------------------------------------------


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
