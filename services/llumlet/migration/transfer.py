"""KV data plane: fused KV frames over TCP from a source's copier to a destination's receiver.

A stage is shipped as one or more frames (at most `frame_bytes` each; a last stage is one small
frame). Frame = fixed header + payload:

    magic "CKV1" | version u16 | flags u16 | migration id 16 B | stage u32 | lease offset u32 |
    num blocks u32 | payload length u64 | payload crc32 u32 | header crc32 u32

The lease offset is the index, in the destination lease's reservation order, of the frame's first
block (source block i of the request goes to lease block i). The receiver reads the payload with
`readinto`-style buffers it owns (no copy in Python), checks the crc, scatters, then answers with
an ack (magic "CKVA" | status u16 | reserved u16 | migration id | stage u32 | lease offset u32).
A header that does not parse closes the connection; a payload whose checksum does not match is
acked with BAD_CHECKSUM and the destination aborts that migration. One connection per destination
is reused across stages and migrations; the source gathers frame k+1 while frame k is on the wire,
and the receiver reads frame k+1 while frame k is being checked and scattered.

The checksum is CRC-32 (ISA-L's when the `isal` package is there: ~16 GB/s against zlib's ~2-4
GB/s on the 2-core CI machine, same values), computed off the event loop for large frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.protocol import (
    DestinationGone,
    DestinationRefused,
    DestinationSlow,
    MigrationFailed,
    MigrationLimits,
    migration_id_bytes,
    migration_id_from_bytes,
)

log = logging.getLogger(__name__)

MAGIC = b"CKV1"
ACK_MAGIC = b"CKVA"
VERSION = 1
_HEADER = struct.Struct("!4sHH16sIIIQI")  # everything but the trailing header crc
HEADER_SIZE = _HEADER.size + 4
_ACK = struct.Struct("!4sHH16sII")
ACK_SIZE = _ACK.size
_INLINE_CRC_MAX_BYTES = 1 << 20

try:  # ISA-L's CRC-32 (same polynomial and values as zlib's, ~5-10x faster with PCLMUL)
    from isal.isal_zlib import crc32 as payload_crc32
except ImportError:  # pragma: no cover - optional speed-up; both ends agree either way
    payload_crc32 = zlib.crc32


class FrameError(ValueError):
    """A header that does not parse: the stream cannot be trusted past it."""


class AckStatus(enum.IntEnum):
    OK = 0
    BAD_CHECKSUM = 1
    UNKNOWN_MIGRATION = 2  # not (or no longer) running here: aborted, expired, committed
    BAD_RANGE = 3  # blocks outside the lease, or not the next ones
    BAD_SIZE = 4  # payload length does not match the number of blocks
    FAILED = 5  # the scatter itself failed
    TRUNCATED = 6  # never sent: the connection closed mid-frame


@dataclass(frozen=True)
class FrameHeader:
    migration_id: str
    stage: int
    lease_offset: int
    num_blocks: int
    payload_len: int
    payload_crc: int

    def pack(self) -> bytes:
        head = _HEADER.pack(MAGIC, VERSION, 0, migration_id_bytes(self.migration_id), self.stage,
                            self.lease_offset, self.num_blocks, self.payload_len, self.payload_crc)
        return head + zlib.crc32(head).to_bytes(4, "big")

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> FrameHeader:
        if len(raw) != HEADER_SIZE:
            raise FrameError(f"header of {len(raw)} bytes, expected {HEADER_SIZE}")
        head = bytes(raw[: _HEADER.size])
        if zlib.crc32(head) != int.from_bytes(raw[_HEADER.size :], "big"):
            raise FrameError("header checksum mismatch")
        magic, version, _flags, mid, stage, offset, num_blocks, length, crc = _HEADER.unpack(head)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        if version != VERSION:
            raise FrameError(f"unsupported frame version {version}")
        return FrameHeader(migration_id_from_bytes(mid), stage, offset, num_blocks, length, crc)


@dataclass(frozen=True)
class FrameAck:
    status: AckStatus
    migration_id: str
    stage: int
    lease_offset: int

    def pack(self) -> bytes:
        return _ACK.pack(ACK_MAGIC, self.status, 0, migration_id_bytes(self.migration_id), self.stage, self.lease_offset)

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> FrameAck:
        magic, status, _reserved, mid, stage, offset = _ACK.unpack(bytes(raw))
        if magic != ACK_MAGIC:
            raise FrameError(f"bad ack magic {magic!r}")
        try:
            return FrameAck(AckStatus(status), migration_id_from_bytes(mid), stage, offset)
        except ValueError as exc:
            raise FrameError(f"bad ack status {status}") from exc


def frame_chunks(block_ids: Sequence[int], block_bytes: int, frame_bytes: int) -> list[list[int]]:
    """Split a stage's blocks into frames of at most `frame_bytes` (at least one block each)."""
    if not block_ids:
        return [[]]
    per_frame = max(1, frame_bytes // block_bytes) if block_bytes else len(block_ids)
    return [list(block_ids[i : i + per_frame]) for i in range(0, len(block_ids), per_frame)]


# ---------------------------------------------------------------------------------------------
# Destination: the receiver
# ---------------------------------------------------------------------------------------------


class FrameSink(Protocol):
    """The destination's side of a frame (implemented by the incoming-migration registry)."""

    def admit(self, header: FrameHeader) -> AckStatus:
        """May this frame be written now? (migration running, next blocks of its lease, size)"""

    async def write(self, header: FrameHeader, payload: memoryview) -> AckStatus:
        """Scatter the payload into the lease's blocks (while its checksum is being verified:
        the blocks are reserved ones, and a bad checksum fails the whole migration)."""

    def frame_failed(self, header: FrameHeader, status: AckStatus) -> None:
        """A frame of this migration was refused, corrupt or truncated: abort it."""


class KVReceiver:
    """The destination's TCP server: one `_FrameConnection` per source connection."""

    def __init__(self, sink: FrameSink, limits: MigrationLimits, buffer_factory: Callable[[int], np.ndarray],
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        self.sink = sink
        self.limits = limits
        self.buffer_factory = buffer_factory
        self.host, self.port = host, port
        self.advertise_host = advertise_host or _reachable_host(host)
        self.address = ""
        self._server: asyncio.Server | None = None
        self._connections: set[_FrameConnection] = set()
        self._workers: set[asyncio.Task] = set()  # one per connection; outlives it by its last frames
        self._crc_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-crc")

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _FrameConnection(self), self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.advertise_host}:{port}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        for worker in list(self._workers):
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._crc_executor.shutdown(wait=False, cancel_futures=True)

    def _track(self, worker: asyncio.Task) -> None:
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)

    async def checksum(self, payload: memoryview) -> int:
        if payload.nbytes <= _INLINE_CRC_MAX_BYTES:
            return payload_crc32(payload)
        return await asyncio.get_running_loop().run_in_executor(self._crc_executor, payload_crc32, payload)


def _reachable_host(bind_host: str) -> str:
    """What peers should dial: the bind address, or this host's address for a wildcard bind."""
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _FrameConnection(asyncio.BufferedProtocol):
    """Reads header, then payload, straight into buffers it owns; a worker task checks,
    scatters and acks complete frames in order while the next one is being received."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(HEADER_SIZE)
        self._buffers: list[np.ndarray] = []
        self._free_buffers: list[int] = []
        self._frame: FrameHeader | None = None  # payload being received
        self._target: memoryview = memoryview(self._header)
        self._pos = 0
        self._buffer_index = -1
        self._complete: asyncio.Queue[tuple[FrameHeader, int] | None] = asyncio.Queue()
        self._paused = False

    # -- asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.receiver._connections.add(self)
        self.receiver._track(asyncio.get_running_loop().create_task(self._process(), name="kv-receiver"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._pos :]

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        if self._pos < len(self._target):
            return
        if self._frame is None:
            self._header_done()
        else:
            self._payload_done()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver._connections.discard(self)
        if self._frame is not None:  # a frame was cut short: that migration cannot go on
            self.receiver.sink.frame_failed(self._frame, AckStatus.TRUNCATED)
            self._frame = None
        self._complete.put_nowait(None)  # stops the worker once the frames before are done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- framing --------------------------------------------------------------------------------

    def _header_done(self) -> None:
        try:
            header = FrameHeader.unpack(self._header)
            if header.payload_len > self.receiver.limits.max_frame_bytes:
                raise FrameError(f"frame of {header.payload_len} bytes exceeds the limit")
        except FrameError as exc:
            log.warning("KV connection: %s; closing it", exc)
            self.close()
            return
        self._frame = header
        self._buffer_index = self._take_buffer(header.payload_len)
        self._target = memoryview(self._buffers[self._buffer_index])[: header.payload_len]
        self._pos = 0
        if header.payload_len == 0:
            self._payload_done()

    def _payload_done(self) -> None:
        assert self._frame is not None
        self._complete.put_nowait((self._frame, self._buffer_index))
        self._frame = None
        self._target, self._pos = memoryview(self._header), 0
        if not self._free_buffers and len(self._buffers) >= 2:
            self._paused = True  # both buffers hold frames not yet scattered
            self.transport.pause_reading()

    def _take_buffer(self, nbytes: int) -> int:
        if not self._free_buffers:
            self._buffers.append(self.receiver.buffer_factory(max(nbytes, 1)))
            return len(self._buffers) - 1
        index = self._free_buffers.pop()
        if self._buffers[index].nbytes < nbytes:
            self._buffers[index] = self.receiver.buffer_factory(nbytes)
        return index

    def _give_back(self, index: int) -> None:
        self._free_buffers.append(index)
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    # -- checking, scattering, acking -----------------------------------------------------------

    async def _process(self) -> None:
        while (item := await self._complete.get()) is not None:
            header, index = item
            try:
                status = await self._apply(header, memoryview(self._buffers[index])[: header.payload_len])
            except Exception:
                log.exception("KV frame of migration %s failed", header.migration_id)
                status = AckStatus.FAILED
            finally:
                self._give_back(index)
            if status is not AckStatus.OK:
                self.receiver.sink.frame_failed(header, status)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(FrameAck(status, header.migration_id, header.stage, header.lease_offset).pack())

    async def _apply(self, header: FrameHeader, payload: memoryview) -> AckStatus:
        """Checksum and scatter run side by side: the blocks written are reserved ones that no
        request owns, and a bad checksum aborts the migration (its lease is never committed)."""
        sink = self.receiver.sink
        status = sink.admit(header)
        if status is not AckStatus.OK:
            return status
        crc, status = await asyncio.gather(self.receiver.checksum(payload), sink.write(header, payload))
        return AckStatus.BAD_CHECKSUM if crc != header.payload_crc else status


# ---------------------------------------------------------------------------------------------
# Source: connections to destinations
# ---------------------------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad KV address {address!r} (expected host:port)")
    return host.strip("[]"), int(port)


@dataclass
class StageTransfer:
    """What one stage cost on the wire (for stats and the benchmark)."""

    num_blocks: int
    num_bytes: int
    num_frames: int
    seconds: float


class KVConnection:
    """One TCP connection to a destination's receiver; one stage on it at a time."""

    def __init__(self, address: str, limits: MigrationLimits) -> None:
        self.address = address
        self.limits = limits
        self.lock = asyncio.Lock()
        self._sock: socket.socket | None = None
        self._ack = bytearray(ACK_SIZE)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    async def connect(self) -> None:
        host, port = parse_address(self.address)
        loop = asyncio.get_running_loop()
        info = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, type_, proto, _, sockaddr = info[0]
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, sockaddr), self.limits.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise DestinationGone(f"cannot connect to KV receiver {self.address}: {exc!r}") from exc
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def send_stage(self, migration_id: str, stage: int, lease_offset: int, block_ids: Sequence[int],
                         copier: BlockCopier, checksum: Callable, between_frames: Callable[[], None]) -> StageTransfer:
        """Ship the blocks as frames and wait for every ack. `between_frames` raises to stop
        early (the request is gone). Any failure closes the connection (its framing state is
        unknown) and raises a MigrationFailed subclass."""
        loop = asyncio.get_running_loop()
        chunks = frame_chunks(block_ids, copier.block_bytes, self.limits.effective_frame_bytes())
        total = copier.frame_bytes(len(block_ids))
        started = loop.time()
        try:
            async with asyncio.timeout(self.limits.stage_timeout_s(total)):
                if self._sock is None:
                    await self.connect()
                await self._send_frames(migration_id, stage, lease_offset, chunks, copier, checksum, between_frames)
                await self._read_acks(migration_id, len(chunks))
        except MigrationFailed as exc:
            if not isinstance(exc, DestinationRefused):
                self.close()  # stopped between frames: the acks of the frames sent are unread
            raise
        except TimeoutError as exc:
            self.close()
            raise DestinationSlow(f"stage {stage} to {self.address} timed out") from exc
        except (OSError, FrameError, EOFError) as exc:
            self.close()
            raise DestinationGone(f"KV connection to {self.address} failed: {exc!r}") from exc
        except BaseException:
            self.close()  # cancelled mid-frame: the stream is unusable
            raise
        return StageTransfer(len(block_ids), total, len(chunks), loop.time() - started)

    async def _send_frames(self, migration_id, stage, lease_offset, chunks, copier, checksum, between_frames) -> None:
        loop, sock = asyncio.get_running_loop(), self._sock

        async def prepare(chunk: list[int], slot: int) -> tuple[memoryview, int]:
            view = await copier.gather(chunk, slot)
            return view, await checksum(view)

        pending = asyncio.ensure_future(prepare(chunks[0], 0))
        offset, sent, started = lease_offset, 0, loop.time()
        rate = self.limits.bandwidth_bytes_per_s
        try:
            for i, chunk in enumerate(chunks):
                view, crc = await pending
                between_frames()
                if rate and (ahead := started + sent / rate - loop.time()) > 0:
                    await asyncio.sleep(ahead)  # bandwidth cap
                if i + 1 < len(chunks):  # fuse the next frame while this one is on the wire
                    pending = asyncio.ensure_future(prepare(chunks[i + 1], (i + 1) % 2))
                header = FrameHeader(migration_id, stage, offset, len(chunk), view.nbytes, crc)
                await loop.sock_sendall(sock, header.pack())
                if view.nbytes:
                    await loop.sock_sendall(sock, view)
                offset += len(chunk)
                sent += view.nbytes
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    async def _read_acks(self, migration_id: str, count: int) -> None:
        loop, sock, buf = asyncio.get_running_loop(), self._sock, memoryview(self._ack)
        refused: FrameAck | None = None
        for _ in range(count):
            got = 0
            while got < ACK_SIZE:
                n = await loop.sock_recv_into(sock, buf[got:])
                if n == 0:
                    raise EOFError("KV receiver closed the connection")
                got += n
            ack = FrameAck.unpack(buf)
            if ack.migration_id != migration_id:
                raise FrameError(f"ack for migration {ack.migration_id}, expected {migration_id}")
            if ack.status is not AckStatus.OK and refused is None:
                refused = ack
        if refused is not None:
            raise DestinationRefused(f"KV frame refused: {refused.status.name} (stage {refused.stage})")


class KVSenderPool:
    """Connections by destination address, opened on first use and reused."""

    def __init__(self, limits: MigrationLimits) -> None:
        self.limits = limits
        self._connections: dict[str, KVConnection] = {}
        self._crc_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-crc-out")

    def connection(self, address: str) -> KVConnection:
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = KVConnection(address, self.limits)
        return connection

    async def checksum(self, payload: memoryview) -> int:
        if payload.nbytes <= _INLINE_CRC_MAX_BYTES:
            return payload_crc32(payload)
        return await asyncio.get_running_loop().run_in_executor(self._crc_executor, payload_crc32, payload)

    async def send_stage(self, address: str, migration_id: str, stage: int, lease_offset: int,
                         block_ids: Sequence[int], copier: BlockCopier,
                         between_frames: Callable[[], None] = lambda: None) -> StageTransfer:
        connection = self.connection(address)
        async with connection.lock:
            return await connection.send_stage(migration_id, stage, lease_offset, block_ids, copier, self.checksum,
                                               between_frames)

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
        self._crc_executor.shutdown(wait=False, cancel_futures=True)
