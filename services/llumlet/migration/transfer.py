"""KV data plane: fused KV frames over TCP from a source's copier to a destination's receiver.

A stage is shipped as one or more frames (at most `frame_bytes` each; a last stage is one small
frame). Frame = header + payload + trailer:

    header:  magic "CKV2" | version u16 | flags u16 | migration id 16 B | stage u32 |
             lease offset u32 | num blocks u32 | payload length u64 | header crc32 u32
    payload: the blocks' bytes in fused order (see `copier`)
    trailer: payload crc32 u32

The lease offset is the index, in the destination lease's reservation order, of the frame's first
block (source block i of the request goes to lease block i). The receiver reads the payload into
memory it owns, or straight into the target blocks when the sink lends them (`DirectFrameSink`),
with `BufferedProtocol` (no copy in Python); then it answers with an ack (magic "CKVA" | status
u16 | reserved u16 | migration id | stage u32 | lease offset u32). A header that does not parse
closes the connection. A payload whose checksum does not match is never scattered (a lent one
is never counted as written): it is acked with BAD_CHECKSUM and the destination aborts that
migration; a connection closed mid-frame aborts it too (TRUNCATED). One connection per
destination is reused across stages and migrations.

CPU per byte is what bounds the rate (2 cores, shared with the engines and everything else; see
benchmarks/migration_sim.py), so each byte is touched as few times as possible:
- source: plain host memory is sent straight from the KV blocks (vectored `sendmsg`, no gather);
  each piece (PIECE_BYTES) is checksummed right after the kernel copied it, so the crc reads it
  from cache. Hence the crc trails the payload. (A gather, where one is needed, overlaps the
  previous frame's send.)
- destination: the crc runs on each read as it lands (from cache again), on the event loop. A
  staged frame is scattered by the copier's threads while the next one is received; a lent one
  needs no scatter (measured: 0.34-0.44 → 0.18-0.25 CPU-s/GB on the receiving side).

The checksum is CRC-32 (ISA-L's when the `isal` package is there: 15-25 GB/s from memory, 35-50
from cache, against zlib's ~4 GB/s on the 2-core CI machine; same values).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import logging
import socket
import struct
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

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

MAGIC = b"CKV2"
ACK_MAGIC = b"CKVA"
VERSION = 2
_HEADER = struct.Struct("!4sHH16sIIIQ")  # everything but the trailing header crc
HEADER_SIZE = _HEADER.size + 4
_TRAILER = struct.Struct("!I")
TRAILER_SIZE = _TRAILER.size
_ACK = struct.Struct("!4sHH16sII")
ACK_SIZE = _ACK.size
# Sent then checksummed (source), or read then checksummed (destination), at a time: small enough
# to stay in cache (L3) between the copy and the crc, large enough that the per-piece Python cost
# (~10 µs) is nothing next to the copy (~1.5 ms). 1 MiB measured no better.
PIECE_BYTES = 4 << 20
_IOV_MAX = 1024  # vectors per sendmsg (Linux's IOV_MAX)

_CRC_POLY = 0xEDB88320  # reflected CRC-32


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (zlib's multmodp; `a` is never 0 here)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine: the CRC of A+B from crc(A), crc(B) and len(B) (the fallback
    without ISA-L; pure Python, ~10 µs)."""
    p, n, k = 1 << 31, len2, 3  # x^0; len2 bytes = 8 * len2 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


try:  # ISA-L's CRC-32 (same polynomial and values as zlib's, ~5-10x faster with PCLMUL)
    from isal.isal_zlib import crc32 as payload_crc32
    from isal.isal_zlib import crc32_combine
except ImportError:  # pragma: no cover - optional speed-up; both ends agree either way
    payload_crc32, crc32_combine = zlib.crc32, _crc32_combine


def crc32_of(views: Sequence[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = payload_crc32(view, crc)
    return crc


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
    payload_crc: int = 0  # carried by the trailer: known once the payload is in

    def pack(self) -> bytes:
        head = _HEADER.pack(MAGIC, VERSION, 0, migration_id_bytes(self.migration_id), self.stage,
                            self.lease_offset, self.num_blocks, self.payload_len)
        return head + zlib.crc32(head).to_bytes(4, "big")

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> FrameHeader:
        if len(raw) != HEADER_SIZE:
            raise FrameError(f"header of {len(raw)} bytes, expected {HEADER_SIZE}")
        head = bytes(raw[: _HEADER.size])
        if zlib.crc32(head) != int.from_bytes(raw[_HEADER.size :], "big"):
            raise FrameError("header checksum mismatch")
        magic, version, _flags, mid, stage, offset, num_blocks, length = _HEADER.unpack(head)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        if version != VERSION:
            raise FrameError(f"unsupported frame version {version}")
        return FrameHeader(migration_id_from_bytes(mid), stage, offset, num_blocks, length)


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
        """Scatter the (checksum-verified) payload into the lease's blocks."""

    def frame_failed(self, header: FrameHeader, status: AckStatus) -> None:
        """A frame of this migration was refused, corrupt or truncated: abort it."""


class DirectFrameSink(FrameSink, Protocol):
    """A sink that can lend its blocks, so that the payload is received straight into them (no
    staging buffer, no scatter). Used when the sink has these methods."""

    def open_frame(self, header: FrameHeader) -> Sequence[memoryview] | AckStatus | None:
        """Admit the frame and lend writable views of its target blocks in fused order (see
        `BlockCopier.block_views`), pinned until `close_frame`; an AckStatus refuses it; None
        takes the staged path (`write`) for this frame."""

    def close_frame(self, header: FrameHeader, ok: bool) -> AckStatus:
        """The lent views are no longer written: unpin them. `ok`: the whole payload arrived and
        its checksum matched, so the blocks count as written; otherwise they hold garbage."""


class KVReceiver:
    """The destination's TCP server: one `_FrameConnection` per source connection."""

    def __init__(self, sink: FrameSink, limits: MigrationLimits, buffer_factory: Callable[[int], np.ndarray],
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        self.sink = sink
        self.sink_lends_blocks = callable(getattr(sink, "open_frame", None))  # a DirectFrameSink
        self.limits = limits
        self.buffer_factory = buffer_factory
        self.host, self.port = host, port
        self.advertise_host = advertise_host or _reachable_host(host)
        self.address = ""
        self._server: asyncio.Server | None = None
        self._connections: set[_FrameConnection] = set()
        self._workers: set[asyncio.Task] = set()  # one per connection; outlives it by its last frames

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

    def _track(self, worker: asyncio.Task) -> None:
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)


def _reachable_host(bind_host: str) -> str:
    """What peers should dial: the bind address, or this host's address for a wildcard bind."""
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _Reading(enum.Enum):
    HEADER = "header"
    PAYLOAD = "payload"
    TRAILER = "trailer"


@dataclass
class _ReceivedFrame:
    header: FrameHeader  # with the trailer's crc
    buffer_index: int | None  # staged payload (None: received straight into lent blocks)
    status: AckStatus | None  # decided already (lent, refused or corrupt); None: scatter it


class _FrameConnection(asyncio.BufferedProtocol):
    """Reads header, payload and trailer straight into memory it owns or the sink lends,
    checksumming the payload as it lands. Staged frames are scattered by a worker task while
    the next frame is being received; the worker also sends every ack, in frame order."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(HEADER_SIZE)
        self._trailer = bytearray(TRAILER_SIZE)
        self._buffers: list[np.ndarray] = []
        self._free_buffers: list[int] = []
        self._reading = _Reading.HEADER
        self._frame: FrameHeader | None = None  # header of the frame being received
        self._targets: list[memoryview] = []  # where the rest of its payload goes, in order
        self._target: memoryview = memoryview(self._header)
        self._pos = 0
        self._crc = 0  # of the payload received so far
        self._buffer_index: int | None = None
        self._lent = False  # the payload goes into blocks the sink lent (open_frame)
        self._refusal: AckStatus | None = None  # the sink refused the frame: its payload is dropped
        self._stall_timer: asyncio.TimerHandle | None = None
        self._payload_read = 0  # bytes, over the connection's life (the stall watch looks at it)
        self._complete: asyncio.Queue[_ReceivedFrame | None] = asyncio.Queue()
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
        if self._reading is _Reading.PAYLOAD:  # a piece at a time: checksummed while in cache
            return self._target[self._pos : self._pos + PIECE_BYTES]
        return self._target[self._pos :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._reading is _Reading.PAYLOAD:
            self._crc = payload_crc32(self._target[self._pos : self._pos + nbytes], self._crc)
            self._payload_read += nbytes
        self._pos += nbytes
        if self._pos < len(self._target):
            return
        if self._reading is _Reading.HEADER:
            self._header_done()
        elif self._reading is _Reading.PAYLOAD:
            self._next_target()
        else:
            self._trailer_done()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver._connections.discard(self)
        if self._frame is not None:  # a frame was cut short: that migration cannot go on
            header, lent = self._frame, self._lent
            self._end_frame()
            if lent:
                self.receiver.sink.close_frame(header, ok=False)
            self.receiver.sink.frame_failed(header, AckStatus.TRUNCATED)
        self._complete.put_nowait(None)  # stops the worker once the frames before are done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- framing --------------------------------------------------------------------------------

    def _expect(self, reading: _Reading, target: memoryview) -> None:
        self._reading, self._target, self._pos = reading, target, 0

    def _header_done(self) -> None:
        try:
            header = FrameHeader.unpack(self._header)
            if header.payload_len > self.receiver.limits.max_frame_bytes:
                raise FrameError(f"frame of {header.payload_len} bytes exceeds the limit")
        except FrameError as exc:
            log.warning("KV connection: %s; closing it", exc)
            self.close()
            return
        self._frame, self._crc = header, 0
        self._targets = self._payload_targets(header)
        self._next_target()

    def _payload_targets(self, header: FrameHeader) -> list[memoryview]:
        """Lent blocks when the sink lends them, else a staging buffer of ours."""
        if header.payload_len and self.receiver.sink_lends_blocks:
            lent = self.receiver.sink.open_frame(header)
            if isinstance(lent, AckStatus):
                self._refusal = lent  # still read (and drop) the payload: the stream goes on
            elif lent is not None:
                views = [view.cast("B") for view in lent]
                assert sum(view.nbytes for view in views) == header.payload_len, "lent views do not fit"
                assert not any(view.readonly for view in views), "lent views must be writable"
                self._lent = True
                self._watch_for_stall()
                return views[::-1]
        self._buffer_index = self._take_buffer(header.payload_len)
        return [memoryview(self._buffers[self._buffer_index])[: header.payload_len]]

    def _next_target(self) -> None:
        while self._targets:
            target = self._targets.pop()
            if target.nbytes:
                self._expect(_Reading.PAYLOAD, target)
                return
        self._expect(_Reading.TRAILER, memoryview(self._trailer))

    def _trailer_done(self) -> None:
        assert self._frame is not None
        (crc,) = _TRAILER.unpack(self._trailer)
        header = dataclasses.replace(self._frame, payload_crc=crc)
        crc_ok = crc == self._crc
        status = self._refusal
        if self._lent:
            status = self.receiver.sink.close_frame(header, ok=crc_ok)
            status = status if crc_ok else AckStatus.BAD_CHECKSUM
        elif status is None and not crc_ok:
            status = AckStatus.BAD_CHECKSUM  # never written: the blocks keep what they had
        self._complete.put_nowait(_ReceivedFrame(header, self._buffer_index, status))
        self._end_frame()
        self._expect(_Reading.HEADER, memoryview(self._header))
        if not self._free_buffers and len(self._buffers) >= 2:
            self._paused = True  # both buffers hold frames not yet scattered
            self.transport.pause_reading()

    def _end_frame(self) -> None:
        self._frame, self._targets, self._buffer_index, self._lent, self._refusal = None, [], None, False, None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _watch_for_stall(self) -> None:
        """Lent blocks are pinned (their lease cannot be freed) while the frame is open: a
        sender that sends nothing for a lease period loses the connection."""
        loop, timeout = asyncio.get_running_loop(), self.receiver.limits.lease_s
        seen = self._payload_read

        def check() -> None:
            nonlocal seen
            if self._payload_read == seen:
                log.warning("KV connection stalled mid-frame for %.1f s; closing it", timeout)
                self.close()
                return
            seen = self._payload_read
            self._stall_timer = loop.call_later(timeout, check)

        self._stall_timer = loop.call_later(timeout, check)

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

    # -- scattering, acking ---------------------------------------------------------------------

    async def _process(self) -> None:
        while (frame := await self._complete.get()) is not None:
            header = frame.header
            try:
                status = frame.status if frame.status is not None else await self._apply(frame)
            except Exception:
                log.exception("KV frame of migration %s failed", header.migration_id)
                status = AckStatus.FAILED
            finally:
                if frame.buffer_index is not None:
                    self._give_back(frame.buffer_index)
            if status is not AckStatus.OK:
                self.receiver.sink.frame_failed(header, status)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(FrameAck(status, header.migration_id, header.stage, header.lease_offset).pack())

    async def _apply(self, frame: _ReceivedFrame) -> AckStatus:
        """A staged frame whose checksum matched: admit it now (the frames before it are
        written), then scatter it."""
        status = self.receiver.sink.admit(frame.header)
        if status is not AckStatus.OK:
            return status
        payload = memoryview(self._buffers[frame.buffer_index])[: frame.header.payload_len]
        return await self.receiver.sink.write(frame.header, payload)


# ---------------------------------------------------------------------------------------------
# Source: connections to destinations
# ---------------------------------------------------------------------------------------------


async def send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, header: FrameHeader,
                     views: Sequence[memoryview], checksum: Callable[[Sequence[memoryview]], Awaitable[int]]) -> None:
    """Header, payload (the views one after another) and trailer. The payload goes out a piece
    (~PIECE_BYTES) at a time, each checksummed right after the kernel took it."""
    outbox = _Outbox(loop, sock)
    outbox.add(memoryview(header.pack()))
    crc = 0
    for piece in _pieces(views, PIECE_BYTES):
        for view in piece:
            outbox.add(view)
        await outbox.flush()
        # After the send: the kernel's copy read the piece from memory, the crc reads it from cache.
        crc = crc32_combine(crc, await checksum(piece), sum(view.nbytes for view in piece))
    outbox.add(memoryview(_TRAILER.pack(crc)))
    await outbox.flush()


def _pieces(views: Sequence[memoryview], piece_bytes: int):
    """The views cut and grouped into lists of about `piece_bytes` (one view may be cut)."""
    piece: list[memoryview] = []
    size = 0
    for view in views:
        view = view.cast("B")
        while view.nbytes:
            part = view[: piece_bytes - size]
            piece.append(part)
            size += part.nbytes
            view = view[part.nbytes :]
            if size == piece_bytes:
                yield piece
                piece, size = [], 0
    if piece:
        yield piece


class _Outbox:
    """What is queued for a non-blocking socket; `flush` sends it all with vectored writes
    (`sendmsg`, no join: the kernel copies straight from each view)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop, self.sock = loop, sock
        self.queue: deque[memoryview] = deque()

    def add(self, view: memoryview) -> None:
        if view.nbytes:
            self.queue.append(view)

    async def flush(self) -> None:
        queue = self.queue
        while queue:
            try:
                sent = self.sock.sendmsg(list(itertools.islice(queue, _IOV_MAX)))
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            while sent:  # drop what went out; the first view left may be cut
                if sent < queue[0].nbytes:
                    queue[0] = queue[0][sent:]
                    break
                sent -= queue.popleft().nbytes

    async def _writable(self) -> None:
        ready = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self.loop.remove_writer(fd)


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
        except (TimeoutError, OSError) as exc:
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

        async def prepare(chunk: list[int], slot: int) -> list[memoryview]:
            views = copier.block_views(chunk)  # plain host memory: sent from the blocks themselves
            return views if views is not None else [await copier.gather(chunk, slot)]

        pending = asyncio.ensure_future(prepare(chunks[0], 0))
        offset, sent, started = lease_offset, 0, loop.time()
        rate = self.limits.bandwidth_bytes_per_s
        try:
            for i, chunk in enumerate(chunks):
                views = await pending
                between_frames()
                if rate and (ahead := started + sent / rate - loop.time()) > 0:
                    await asyncio.sleep(ahead)  # bandwidth cap
                if i + 1 < len(chunks):  # a gather of the next frame overlaps this one's send
                    pending = asyncio.ensure_future(prepare(chunks[i + 1], (i + 1) % 2))
                nbytes = sum(view.nbytes for view in views)
                await send_frame(loop, sock, FrameHeader(migration_id, stage, offset, len(chunk), nbytes), views, checksum)
                offset += len(chunk)
                sent += nbytes
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

    def connection(self, address: str) -> KVConnection:
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = KVConnection(address, self.limits)
        return connection

    async def checksum(self, views: Sequence[memoryview]) -> int:
        """CRC-32 of one piece of a payload (the views one after another). Inline: a piece
        (PIECE_BYTES) is still in cache, ~0.1 ms with ISA-L."""
        return crc32_of(views)

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
