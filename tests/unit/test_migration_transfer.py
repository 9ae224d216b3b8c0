"""KV data plane: a real loopback receiver/sender pair (no NATS); faults on the wire; checksums and
vectored sends. (The wire format alone: test_migration_transfer_wire.py; receiving into lent blocks
and the commit in the last frame: the files beside; harness: kv_link_harness.py.)"""

from __future__ import annotations

import asyncio
import socket
import zlib

import numpy as np
import pytest

from services.llumlet.migration import kv_connection, kv_sender
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.kv_wire import HEADER_SIZE, AckStatus, FrameAck, FrameHeader
from services.llumlet.migration.protocol import DestinationRefused, MigrationLimits, new_migration_id
from tests.support.polling import wait_until
from tests.unit.kv_link_harness import (
    BLOCK_BYTES,
    assert_send_finds_destination_gone,
    closed_by_peer,
    link,
    raw_connection,
    send_raw_frame,
    write_and_hang_up,
    wrong_crc,
)


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
