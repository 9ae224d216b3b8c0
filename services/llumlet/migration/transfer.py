"""KV data plane: fused KV frames over TCP from a source's copier to a destination's receiver.

A stage is shipped as one or more frames (at most `frame_bytes` each; a last stage is one small
frame). Frame = header + payload + trailer [+ commit]:

    header:  magic "CKV3" | version u16 | flags u16 | migration id 16 B | stage u32 |
             lease offset u32 | num blocks u32 | payload length u64 | commit length u32 |
             header crc32 u32
    payload: the blocks' bytes in fused order (see `copier`)
    trailer: payload crc32 u32
    commit:  (commit length > 0: the migration's last frame) the msgpack `MigrationCommit`,
             then its crc32 u32

The lease offset is the index, in the destination lease's reservation order, of the frame's first
block (source block i of the request goes to lease block i). The receiver reads the payload into
memory it owns, or straight into the target blocks when the sink lends them (`DirectFrameSink`),
with `BufferedProtocol` (no copy in Python); then it answers with an ack (magic "CKA3" | status
u16 | detail length u16 | migration id | stage u32 | lease offset u32 | detail, UTF-8). A header
that does not parse, or of another version (v1 and v2 peers), closes the connection. A payload
whose checksum does not match is never scattered (a lent one is never counted as written): it is
acked with BAD_CHECKSUM and the destination aborts that migration; a connection closed mid-frame
aborts it too (TRUNCATED). One connection per destination is reused across stages and migrations.

A frame that carries a commit is the COMMIT of the NATS handshake moved onto the data plane: once
its payload is written (and verified), the destination commits through the same idempotent path
as a NATS COMMIT and answers in that frame's ack (COMMITTED, or COMMIT_REFUSED with the reason;
a frame that failed fails the migration, so its error status is a refusal too). The source takes
that ack as the commit's: no NATS hop, no wait for the frame, in the downtime. When the ack never
comes (connection lost after the commit went out, timeout) the outcome is unknown and the source
asks again over NATS (`CommitOutcomeUnknown`).

CPU per byte is what bounds the rate (2 cores, shared with the engines and everything else; see
benchmarks/migration_sim.py), so each byte is touched as few times as possible:
- source: plain host memory is sent straight from the KV blocks (vectored `sendmsg`, no gather);
  each piece (SEND_PIECE_BYTES, fits L2) is checksummed right before the kernel copies it, so the
  copy reads it from cache. The crc trails the payload (known once the last piece is out). (A gather, where one is needed, overlaps the
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
    CommitOutcomeUnknown,
    DestinationGone,
    DestinationRefused,
    DestinationSlow,
    MigrationFailed,
    MigrationLimits,
    migration_id_bytes,
    migration_id_from_bytes,
)

log = logging.getLogger(__name__)

MAGIC = b"CKV3"
ACK_MAGIC = b"CKA3"
VERSION = 3
_HEADER = struct.Struct("!4sHH16sIIIQI")  # everything but the trailing header crc
HEADER_SIZE = _HEADER.size + 4
_TRAILER = struct.Struct("!I")
TRAILER_SIZE = _TRAILER.size
_ACK = struct.Struct("!4sHH16sII")
ACK_SIZE = _ACK.size
# Read then checksummed (destination) at most this at a time: small enough to stay in cache (L3)
# between the kernel's copy and the crc, large enough that the per-read Python cost is nothing.
PIECE_BYTES = 4 << 20
# Checksummed then sent (source) this at a time: the crc brings the piece into L2 (1 MiB per core
# here), so the kernel's copy reads it from there instead of memory. Measured (2 cores, 256 MiB,
# interleaved with raw copies): sender 0.24-0.26 CPU-s/GB, ratio to raw 1.00, against 0.26-0.34 and
# 0.87-0.89 sending 4 MiB pieces first and checksumming them from L3 after.
SEND_PIECE_BYTES = 512 << 10
# The sender lets the event loop run other work (the engine's outputs, a simulated engine's step)
# at least this often: while the socket keeps draining, a stage of a long request would otherwise
# hold the source's loop for as long as its socket buffer takes to fill.
SEND_YIELD_BYTES = 4 << 20
_IOV_MAX = 1024  # vectors per sendmsg (Linux's IOV_MAX)
# While a payload streams in, the receiver asks the kernel not to wake it before this much has
# arrived (SO_RCVLOWAT; never more than the frame still owes): fewer, larger reads, fewer trips
# through the event loop and Python per byte.
RCVLOWAT_BYTES = 1 << 20
MAX_COMMIT_BYTES = 4 << 20  # a commit section (the request's prompt and output ids) is far smaller

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
    COMMITTED = 7  # a commit frame: written, and the request runs here now (also: committed before)
    COMMIT_REFUSED = 8  # a commit frame: the commit was refused (the ack's detail says why)

    @property
    def is_error(self) -> bool:
        return self not in (AckStatus.OK, AckStatus.COMMITTED)


@dataclass(frozen=True)
class FrameHeader:
    migration_id: str
    stage: int
    lease_offset: int
    num_blocks: int
    payload_len: int
    payload_crc: int = 0  # carried by the trailer: known once the payload is in
    commit_len: int = 0  # bytes of the commit section after the trailer (0: no commit)

    def pack(self) -> bytes:
        head = _HEADER.pack(MAGIC, VERSION, 0, migration_id_bytes(self.migration_id), self.stage,
                            self.lease_offset, self.num_blocks, self.payload_len, self.commit_len)
        return head + zlib.crc32(head).to_bytes(4, "big")

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> FrameHeader:
        if len(raw) != HEADER_SIZE:
            raise FrameError(f"header of {len(raw)} bytes, expected {HEADER_SIZE}")
        head = bytes(raw[: _HEADER.size])
        magic, version = head[:4], int.from_bytes(head[4:6], "big")
        if magic[:3] == MAGIC[:3] and (magic != MAGIC or version != VERSION):  # v1, v2 (other layouts)
            raise FrameError(f"unsupported frame version {magic!r}/{version} (this receiver speaks {VERSION})")
        if zlib.crc32(head) != int.from_bytes(raw[_HEADER.size :], "big"):
            raise FrameError("header checksum mismatch")
        magic, version, _flags, mid, stage, offset, num_blocks, length, commit_len = _HEADER.unpack(head)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        return FrameHeader(migration_id_from_bytes(mid), stage, offset, num_blocks, length, commit_len=commit_len)


_MAX_DETAIL_BYTES = 1024


@dataclass(frozen=True)
class FrameAck:
    status: AckStatus
    migration_id: str
    stage: int
    lease_offset: int
    detail: str = ""  # why (a refused commit)

    def pack(self) -> bytes:
        detail = self.detail.encode("utf-8", "replace")[:_MAX_DETAIL_BYTES]
        return _ACK.pack(ACK_MAGIC, self.status, len(detail), migration_id_bytes(self.migration_id), self.stage,
                         self.lease_offset) + detail

    @staticmethod
    def unpack_fixed(raw: bytes | bytearray | memoryview) -> tuple[FrameAck, int]:
        """The ack's fixed part, and how many detail bytes follow it."""
        magic, status, detail_len, mid, stage, offset = _ACK.unpack(bytes(raw))
        if magic != ACK_MAGIC:
            raise FrameError(f"bad ack magic {magic!r}")
        if detail_len > _MAX_DETAIL_BYTES:
            raise FrameError(f"ack detail of {detail_len} bytes")
        try:
            return FrameAck(AckStatus(status), migration_id_from_bytes(mid), stage, offset), detail_len
        except ValueError as exc:
            raise FrameError(f"bad ack status {status}") from exc

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> FrameAck:
        ack, detail_len = FrameAck.unpack_fixed(raw[:ACK_SIZE])
        if len(raw) != ACK_SIZE + detail_len:
            raise FrameError(f"ack of {len(raw)} bytes, expected {ACK_SIZE + detail_len}")
        return dataclasses.replace(ack, detail=bytes(raw[ACK_SIZE:]).decode("utf-8", "replace"))


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


class CommitSink(FrameSink, Protocol):
    """A sink that takes commits in frames (implemented by the incoming-migration registry)."""

    async def commit_frame(self, header: FrameHeader, commit: bytes, frame_status: AckStatus) -> tuple[AckStatus, str]:
        """The frame that carried `commit` (msgpack `MigrationCommit`, checksum verified) ended
        with `frame_status` (its failure, if any, was reported already). Commit if it may, the
        way a NATS COMMIT does; the answer (COMMITTED, or an error status and why) is its ack."""


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
        self.sink_commits = callable(getattr(sink, "commit_frame", None))  # a CommitSink
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
    COMMIT = "commit"


@dataclass
class _ReceivedFrame:
    header: FrameHeader  # with the trailer's crc
    buffer_index: int | None  # staged payload (None: received straight into lent blocks)
    status: AckStatus | None  # decided already (lent, refused or corrupt); None: scatter it
    commit: bytes | None = None  # the commit it carries (verified), to be decided after the frame


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
        self._received: _ReceivedFrame | None = None  # payload and trailer in, commit section being read
        self._sock: socket.socket | None = None
        self._lowat = 1  # the socket's SO_RCVLOWAT now (0: the kernel does not take it)
        self._payload_left = 0  # bytes of the current frame's payload not yet received

    # -- asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
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
            self._payload_left -= nbytes
            self._wake_after(self._payload_left)
        self._pos += nbytes
        if self._pos < len(self._target):
            return
        if self._reading is _Reading.HEADER:
            self._header_done()
        elif self._reading is _Reading.PAYLOAD:
            self._next_target()
        elif self._reading is _Reading.TRAILER:
            self._trailer_done()
        else:
            self._commit_done()

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
            if header.commit_len > MAX_COMMIT_BYTES:
                raise FrameError(f"commit of {header.commit_len} bytes exceeds the limit")
        except FrameError as exc:
            log.warning("KV connection: %s; closing it", exc)
            self.close()
            return
        self._frame, self._crc, self._payload_left = header, 0, header.payload_len
        self._targets = self._payload_targets(header)
        self._next_target()
        self._wake_after(header.payload_len)

    def _wake_after(self, payload_left: int) -> None:
        """Let the kernel wake us once min(RCVLOWAT_BYTES, what the payload still owes) bytes
        are in (1 past the payload: the trailer and the next header are small). Never more than
        the frame owes: a low-water mark the sender never reaches would stall the frame."""
        want = max(1, min(payload_left, RCVLOWAT_BYTES))
        if want == self._lowat or not self._lowat or self._sock is None:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self._lowat = want
        except OSError:  # (not a TCP socket the kernel lets us tune: plain wake-ups)
            self._lowat = 0

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
        frame = _ReceivedFrame(header, self._buffer_index, status)
        if header.commit_len:
            self._lent = False  # (closed above: nothing pinned while the commit is read)
            self._received = frame
            self._expect(_Reading.COMMIT, memoryview(bytearray(header.commit_len + TRAILER_SIZE)))
            return
        self._frame_done(frame)

    def _commit_done(self) -> None:
        frame, section = self._received, self._target.obj
        assert frame is not None
        commit = bytes(section[: frame.header.commit_len])
        (crc,) = _TRAILER.unpack_from(section, frame.header.commit_len)
        if crc != zlib.crc32(commit) and not (frame.status is not None and frame.status.is_error):
            frame.status = AckStatus.BAD_CHECKSUM  # (a staged payload is then never written either)
        frame.commit = commit
        self._frame_done(frame)

    def _frame_done(self, frame: _ReceivedFrame) -> None:
        self._complete.put_nowait(frame)
        self._received = None
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
            detail = ""
            if frame.commit is not None:
                status, detail = await self._commit(frame, status)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(FrameAck(status, header.migration_id, header.stage, header.lease_offset,
                                              detail).pack())

    async def _commit(self, frame: _ReceivedFrame, frame_status: AckStatus) -> tuple[AckStatus, str]:
        if not self.receiver.sink_commits:
            return AckStatus.COMMIT_REFUSED, "this receiver takes no commit in a frame"
        try:
            return await self.receiver.sink.commit_frame(frame.header, frame.commit, frame_status)
        except Exception:
            log.exception("commit in a KV frame of migration %s failed", frame.header.migration_id)
            return AckStatus.FAILED, "commit failed on the destination"

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
                     views: Sequence[memoryview], checksum: Callable[[Sequence[memoryview]], Awaitable[int]],
                     commit: bytes = b"") -> None:
    """Header, payload (the views one after another), trailer and the commit section (when the
    header announces one). The payload goes out a piece (~SEND_PIECE_BYTES) at a time, each
    checksummed right before the kernel copies it (from cache, then)."""
    assert header.commit_len == len(commit), (header.commit_len, len(commit))
    outbox = _Outbox(loop, sock)
    outbox.add(memoryview(header.pack()))
    crc = 0
    since_yield = 0
    for piece in _pieces(views, SEND_PIECE_BYTES):
        piece_bytes = sum(view.nbytes for view in piece)
        crc = crc32_combine(crc, await checksum(piece), piece_bytes)
        for view in piece:
            outbox.add(view)
        await outbox.flush()
        since_yield += piece_bytes
        if since_yield >= SEND_YIELD_BYTES:
            since_yield = 0
            await asyncio.sleep(0)
    outbox.add(memoryview(_TRAILER.pack(crc)))
    if commit:
        outbox.add(memoryview(commit))
        outbox.add(memoryview(_TRAILER.pack(zlib.crc32(commit))))
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
    committed: bool = False  # its last frame carried a commit, and the destination committed


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
                         copier: BlockCopier, checksum: Callable, between_frames: Callable[[], None],
                         commit: bytes = b"") -> StageTransfer:
        """Ship the blocks as frames and wait for every ack. `between_frames` raises to stop
        early (the request is gone). Any failure closes the connection (its framing state is
        unknown) and raises a MigrationFailed subclass.

        With `commit` (an encoded `MigrationCommit`), the last frame (an empty one if there are
        no blocks) carries it: returns with `committed` once the destination committed, raises
        DestinationRefused when it surely did not (its ack said so), and CommitOutcomeUnknown
        when the commit may have gone out but no ack came back."""
        loop = asyncio.get_running_loop()
        chunks = frame_chunks(block_ids, copier.block_bytes, self.limits.effective_frame_bytes())
        total = copier.frame_bytes(len(block_ids))
        started = loop.time()
        commit_sent = _CommitSent()
        try:
            async with asyncio.timeout(self.limits.stage_timeout_s(total)):
                if self._sock is None:
                    await self.connect()
                await self._send_frames(migration_id, stage, lease_offset, chunks, copier, checksum, between_frames,
                                        commit, commit_sent)
                last = await self._read_acks(migration_id, len(chunks))
        except DestinationRefused:
            raise  # (every ack was read: the connection goes on; a refused commit is definite)
        except BaseException as exc:
            self.close()  # its framing state is unknown (stopped or cut mid-frame, acks unread)
            if commit_sent.commit and not isinstance(exc, asyncio.CancelledError):
                raise CommitOutcomeUnknown(f"commit in stage {stage} to {self.address}: no ack ({exc!r})") from exc
            if isinstance(exc, MigrationFailed) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, TimeoutError):
                raise DestinationSlow(f"stage {stage} to {self.address} timed out") from exc
            if isinstance(exc, (OSError, FrameError, EOFError)):
                raise DestinationGone(f"KV connection to {self.address} failed: {exc!r}") from exc
            raise
        committed = bool(commit) and last is not None and last.status is AckStatus.COMMITTED
        if commit and not committed:  # (an ack that is neither: a receiver that did not read the commit)
            raise DestinationRefused(f"commit not acknowledged: {last.status.name if last else 'no ack'}")
        return StageTransfer(len(block_ids), total, len(chunks), loop.time() - started, committed)

    async def _send_frames(self, migration_id, stage, lease_offset, chunks, copier, checksum, between_frames,
                           commit: bytes, commit_sent: _CommitSent) -> None:
        loop, sock = asyncio.get_running_loop(), self._sock

        async def gather(chunk: list[int], slot: int) -> list[memoryview]:
            return [await copier.gather(chunk, slot)]

        def prepare(chunk: list[int], slot: int) -> asyncio.Future:
            views = copier.block_views(chunk)  # plain host memory: sent from the blocks themselves
            if views is None:
                return asyncio.ensure_future(gather(chunk, slot))
            ready = loop.create_future()  # (awaited without a trip around the event loop: a last
            ready.set_result(views)  # frame goes out at once, in the downtime every hop counts)
            return ready

        pending = prepare(chunks[0], 0)
        offset, sent, started = lease_offset, 0, loop.time()
        rate = self.limits.bandwidth_bytes_per_s
        try:
            for i, chunk in enumerate(chunks):
                views = await pending
                between_frames()
                if rate and (ahead := started + sent / rate - loop.time()) > 0:
                    await asyncio.sleep(ahead)  # bandwidth cap
                if i + 1 < len(chunks):  # a gather of the next frame overlaps this one's send
                    pending = prepare(chunks[i + 1], (i + 1) % 2)
                nbytes = sum(view.nbytes for view in views)
                carried = commit if i + 1 == len(chunks) else b""
                commit_sent.commit = bool(carried)  # from its first byte on, the destination may commit
                header = FrameHeader(migration_id, stage, offset, len(chunk), nbytes, commit_len=len(carried))
                await send_frame(loop, sock, header, views, checksum, carried)
                offset += len(chunk)
                sent += nbytes
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    async def _read_acks(self, migration_id: str, count: int) -> FrameAck | None:
        """Every ack of the stage; returns the last. Raises DestinationRefused (after reading
        them all: the connection goes on) if one is an error."""
        refused: FrameAck | None = None
        ack = None
        for _ in range(count):
            ack, detail_len = FrameAck.unpack_fixed(await self._recv_exactly(ACK_SIZE))
            if detail_len:
                ack = dataclasses.replace(ack, detail=bytes(await self._recv_exactly(detail_len)).decode("utf-8", "replace"))
            if ack.migration_id != migration_id:
                raise FrameError(f"ack for migration {ack.migration_id}, expected {migration_id}")
            if ack.status.is_error and refused is None:
                refused = ack
        if refused is not None:
            what = "commit refused" if refused.status is AckStatus.COMMIT_REFUSED else "KV frame refused"
            detail = f": {refused.detail}" if refused.detail else ""
            raise DestinationRefused(f"{what}: {refused.status.name} (stage {refused.stage}){detail}")
        return ack

    async def _recv_exactly(self, nbytes: int) -> memoryview:
        loop, sock = asyncio.get_running_loop(), self._sock
        if len(self._ack) < nbytes:
            self._ack = bytearray(nbytes)
        buf = memoryview(self._ack)[:nbytes]
        got = 0
        while got < nbytes:
            n = await loop.sock_recv_into(sock, buf[got:])
            if n == 0:
                raise EOFError("KV receiver closed the connection")
            got += n
        return buf


@dataclass
class _CommitSent:
    commit: bool = False  # a frame carrying the commit started going out


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
        (SEND_PIECE_BYTES) is read into cache for the send that follows, ~20 µs with ISA-L."""
        return crc32_of(views)

    async def send_stage(self, address: str, migration_id: str, stage: int, lease_offset: int,
                         block_ids: Sequence[int], copier: BlockCopier,
                         between_frames: Callable[[], None] = lambda: None, commit: bytes = b"") -> StageTransfer:
        """See `KVConnection.send_stage` (`commit`: the last frame carries the COMMIT)."""
        connection = self.connection(address)
        async with connection.lock:
            return await connection.send_stage(migration_id, stage, lease_offset, block_ids, copier, self.checksum,
                                               between_frames, commit)

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
