"""One source's connection into the KV receiver: reads frames (`kv_wire`) into memory it owns, or
straight into the target blocks when the sink lends them (`BufferedProtocol`: no copy in Python),
checksums each read as it lands, hands verified frames to the sink and acks them in order.

CPU per byte bounds the rate (2 cores, shared with the engines; see benchmarks/migration_sim.py),
so each byte is touched as few times as possible: the crc runs on each read (PIECE_BYTES) while it
is in cache; a staged frame is scattered by the copier's threads while the next one is received;
a lent one needs no scatter (measured: 0.34-0.44 → 0.18-0.25 CPU-s/GB on the receiving side).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.llumlet.migration import kv_auth
from services.llumlet.migration.handover import log_commit_frame
from services.llumlet.migration.kv_wire import (
    HEADER_SIZE,
    MAX_COMMIT_BYTES,
    TRAILER_SIZE,
    AckStatus,
    FrameAck,
    FrameError,
    FrameHeader,
    payload_crc32,
    unpack_crc,
)
from services.llumlet.migration.kv_sink import FrameSink
from services.llumlet.migration.protocol import MigrationLimits

log = logging.getLogger(__name__)

# Read then checksummed at most this at a time: small enough to stay in cache (L3) between the
# kernel's copy and the crc, large enough that the per-read Python cost is nothing.
PIECE_BYTES = 4 << 20
# While a payload streams in, ask the kernel not to wake us before this much has arrived
# (SO_RCVLOWAT; never more than the frame still owes): fewer, larger reads, fewer trips through
# the event loop and Python per byte.
RCVLOWAT_BYTES = 1 << 20



class FrameServer(Protocol):
    """What a connection needs from the server that accepted it (`KVReceiver`)."""

    sink: FrameSink
    sink_lends_blocks: bool  # the sink is a DirectFrameSink
    limits: MigrationLimits
    buffer_factory: Callable[[int], np.ndarray]
    secret: bytes | None  # the deployment's KV secret (`kv_auth`); None: no handshake

    def attach(self, connection: FrameConnection, worker: asyncio.Task) -> None: ...

    def detach(self, connection: FrameConnection) -> None: ...


class _Reading(enum.Enum):
    AUTH = "auth"  # the peer's proof of the deployment's secret (`kv_auth`), before any frame
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
    header_at: float = 0.0  # when its header was read, and when all of it was (monotonic s)
    received_at: float = 0.0


class FrameConnection(asyncio.BufferedProtocol):
    """Reads header, payload and trailer straight into memory it owns or the sink lends,
    checksumming the payload as it lands. Staged frames are scattered by a worker task while
    the next frame is being received; the worker also sends every ack, in frame order."""

    def __init__(self, receiver: FrameServer) -> None:
        self.receiver = receiver
        self.sink = receiver.sink
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(HEADER_SIZE)
        self._trailer = bytearray(TRAILER_SIZE)
        self._buffers: list[np.ndarray] = []
        self._free_buffers: list[int] = []
        self._reading = _Reading.HEADER
        self._frame: FrameHeader | None = None  # header of the frame being received
        self._frame_header_at = 0.0  # when it was read (monotonic s)
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
        self._nonce = b""  # this connection's challenge (`kv_auth`)
        self._auth_timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        self.receiver.attach(self, asyncio.get_running_loop().create_task(self._process(), name="kv-receiver"))
        if self.receiver.secret is not None:
            self._nonce, message = kv_auth.challenge()
            transport.write(message)
            self._expect(_Reading.AUTH, memoryview(bytearray(kv_auth.MESSAGE_SIZE)))
            self._auth_timer = asyncio.get_running_loop().call_later(
                self.receiver.limits.connect_timeout_s, self._auth_timed_out)

    def _auth_timed_out(self) -> None:
        if self._reading is _Reading.AUTH and self.transport is not None and not self.transport.is_closing():
            kv_auth.rejected("timeout", self._peer(), log)
            self.close()

    def _auth_done(self) -> None:
        self._auth_timer.cancel()
        if not kv_auth.verify(self.receiver.secret, self._nonce, self._target):
            kv_auth.rejected("bad_proof", self._peer(), log)
            self._reading = _Reading.AUTH  # (stays: nothing more is read as a frame)
            self.close()
            return
        self._expect(_Reading.HEADER, memoryview(self._header))

    def _peer(self) -> object:
        return self.transport.get_extra_info("peername") if self.transport is not None else None

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
        elif self._reading is _Reading.AUTH:
            self._auth_done()
        elif self._reading is _Reading.PAYLOAD:
            self._next_target()
        elif self._reading is _Reading.TRAILER:
            self._trailer_done()
        else:
            self._commit_done()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver.detach(self)
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        if self._frame is not None:  # a frame was cut short: that migration cannot go on
            header, lent = self._frame, self._lent
            self._end_frame()
            if lent:
                self.sink.close_frame(header, ok=False)
            self.sink.frame_failed(header, AckStatus.TRUNCATED)
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
        self._frame_header_at = time.monotonic()
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
        """Lent blocks when the sink lends them, else a staging buffer of ours. Never lent while
        a staged frame waits for its scatter: the sink admits a lent frame now and a staged one
        when it is scattered, so lending past one would admit them out of order (whole blocks
        of small pieces are staged, the token frame after them lent)."""
        staged_waiting = len(self._buffers) - len(self._free_buffers)
        if header.payload_len and self.receiver.sink_lends_blocks and not staged_waiting:
            lent = self.sink.open_frame(header)
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
        header = dataclasses.replace(self._frame, payload_crc=unpack_crc(self._trailer))
        crc_ok = header.payload_crc == self._crc
        status = self._refusal
        if self._lent:
            status = self.sink.close_frame(header, ok=crc_ok)
            status = status if crc_ok else AckStatus.BAD_CHECKSUM
        elif status is None and not crc_ok:
            status = AckStatus.BAD_CHECKSUM  # never written: the blocks keep what they had
        frame = _ReceivedFrame(header, self._buffer_index, status, header_at=self._frame_header_at)
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
        if unpack_crc(section, frame.header.commit_len) != zlib.crc32(commit) and not (
                frame.status is not None and frame.status.is_error):
            frame.status = AckStatus.BAD_CHECKSUM  # (a staged payload is then never written either)
        frame.commit = commit
        self._frame_done(frame)

    def _frame_done(self, frame: _ReceivedFrame) -> None:
        frame.received_at = time.monotonic()
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

    # -- scattering, committing, acking ---------------------------------------------------------

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
                self.sink.frame_failed(header, status)
            detail = ""
            if frame.commit is not None:
                status, detail = await self._commit(frame, status)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(FrameAck(status, header.migration_id, header.stage, header.lease_offset,
                                              detail).pack())
            if frame.commit is not None:  # (after its ack: the line costs the downtime nothing)
                log_commit_frame(log, header.migration_id, frame.header_at, frame.received_at)

    async def _commit(self, frame: _ReceivedFrame, frame_status: AckStatus) -> tuple[AckStatus, str]:
        try:
            return await self.sink.commit_frame(frame.header, frame.commit, frame_status)
        except Exception:
            log.exception("commit in a KV frame of migration %s failed", frame.header.migration_id)
            return AckStatus.FAILED, "commit failed on the destination"

    async def _apply(self, frame: _ReceivedFrame) -> AckStatus:
        """A staged frame whose checksum matched: admit it now (the frames before it are
        written), then scatter it."""
        status = self.sink.admit(frame.header)
        if status is not AckStatus.OK:
            return status
        payload = memoryview(self._buffers[frame.buffer_index])[: frame.header.payload_len]
        return await self.sink.write(frame.header, payload)
