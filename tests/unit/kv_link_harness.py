"""The KV data plane's test harness: a real loopback receiver/sender pair over numpy pools (no NATS),
raw connections and hand-made frames for the fault tests. Used by test_migration_transfer*.py."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest

from services.llumlet.migration import copier as copier_module
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.kv_wire import (
    ACK_SIZE,
    TRAILER_SIZE,
    AckStatus,
    FrameAck,
    FrameHeader,
    parse_address,
)
from services.llumlet.migration.ops import KVRegion
from services.llumlet.migration.protocol import DestinationGone, MigrationLimits, new_migration_id


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


async def raw_connection(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = parse_address(address)
    return await asyncio.open_connection(host, port)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 2.0) == b""
    except ConnectionResetError:  # closed with our bytes still unread
        return True


async def write_and_hang_up(address: str, data: bytes) -> None:
    """A sender that dies after writing `data` (a frame cut short somewhere)."""
    _, writer = await raw_connection(address)
    writer.write(data)
    await writer.drain()
    writer.close()


async def send_raw_frame(address: str, header: FrameHeader, payload: bytes, crc: int) -> FrameAck:
    """One hand-made frame (header, payload, trailer); the receiver's ack."""
    reader, writer = await raw_connection(address)
    writer.write(header.pack() + payload + crc.to_bytes(TRAILER_SIZE, "big"))
    await writer.drain()
    ack = FrameAck.unpack(await asyncio.wait_for(reader.readexactly(ACK_SIZE), 2.0))
    writer.close()
    return ack


async def assert_send_finds_destination_gone(address: str) -> None:
    copier = BlockCopier([KVRegion(make_pool(4, 0))])
    senders = KVSenderPool(MigrationLimits())
    with pytest.raises(DestinationGone):
        await senders.send_stage(address, new_migration_id(), 0, 0, [1], copier)
    senders.close()
    copier.close()
