"""KV data plane: receiving straight into lent blocks (no staging buffer, no scatter)."""

from __future__ import annotations

import asyncio
import socket
import zlib

import numpy as np
import pytest

from services.llumlet.migration import copier as copier_module
from services.llumlet.migration import kv_connection
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.kv_wire import AckStatus, FrameHeader
from services.llumlet.migration.protocol import DestinationRefused, MigrationLimits, new_migration_id
from tests.support.polling import wait_until
from tests.unit.kv_link_harness import (
    BLOCK_BYTES,
    PoolSink,
    closed_by_peer,
    open_link,
    raw_connection,
    send_raw_frame,
    write_and_hang_up,
)


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
