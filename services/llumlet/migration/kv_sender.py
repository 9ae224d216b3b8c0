"""The source's side of the KV data plane: one TCP connection per destination, a stage at a time,
each shipped as frames (`kv_wire`) and answered by one ack per frame: whole blocks, and where the
KV layout has token slots, the computed slots of a block not yet full as token frames (a `StagePlan`:
the rest of a block begun, whole blocks, the slots of the last). The last stage's last frame
carries the COMMIT; its ack is the commit's answer, and a commit whose ack never came is in doubt
(`CommitOutcomeUnknown`: the source asks again over NATS).

CPU per byte bounds the rate (2 cores, shared with the engines; see benchmarks/migration_sim.py),
so each byte is touched as few times as possible: plain host memory is sent straight from the KV
blocks (vectored `sendmsg`, no gather); each piece (SEND_PIECE_BYTES, fits L2) is checksummed right
before the kernel copies it, so the copy reads it from cache, and the crc trails the payload. A
gather, where one is needed (device memory), overlaps the previous frame's send.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from services.llumlet.migration import kv_auth
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.kv_plan import Chunk, TokenRun
from services.llumlet.migration.kv_wire import (
    ACK_SIZE,
    AckStatus,
    FrameAck,
    FrameError,
    FrameHeader,
    commit_section,
    crc32_combine,
    crc32_of,
    frame_chunks,
    pack_crc,
    parse_address,
    token_chunks,
)
from services.llumlet.migration.protocol import (
    CommitOutcomeUnknown,
    DestinationGone,
    DestinationRefused,
    DestinationSlow,
    MigrationFailed,
    MigrationLimits,
)

# Checksummed then sent this at a time: the crc brings the piece into L2 (1 MiB per core here),
# so the kernel's copy reads it from there instead of memory. Measured (2 cores, 256 MiB,
# interleaved with raw copies): sender 0.24-0.26 CPU-s/GB, ratio to raw 1.00, against 0.26-0.34 and
# 0.87-0.89 sending 4 MiB pieces first and checksumming them from L3 after.
SEND_PIECE_BYTES = 512 << 10
# The sender lets the event loop run other work (the engine's outputs, a simulated engine's step)
# at least this often: while the socket keeps draining, a stage of a long request would otherwise
# hold the source's loop for as long as its socket buffer takes to fill.
SEND_YIELD_BYTES = 4 << 20
_IOV_MAX = 1024  # vectors per sendmsg (Linux's IOV_MAX)

Checksum = Callable[[Sequence[memoryview]], Awaitable[int]]


async def send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, header: FrameHeader,
                     views: Sequence[memoryview], checksum: Checksum, commit: bytes = b"") -> None:
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
    outbox.add(memoryview(pack_crc(crc)))
    outbox.add(memoryview(commit_section(commit)))
    await outbox.flush()


def _pieces(views: Sequence[memoryview], piece_bytes: int) -> Iterator[list[memoryview]]:
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


@dataclass
class StageTransfer:
    """What one stage cost on the wire (for stats and the benchmark)."""

    num_blocks: int
    num_bytes: int
    num_frames: int
    seconds: float
    committed: bool = False  # its last frame carried the commit, and the destination committed


class KVConnection:
    """One TCP connection to a destination's receiver; one stage on it at a time."""

    def __init__(self, address: str, limits: MigrationLimits) -> None:
        self.address = address
        self.limits = limits
        self.lock = asyncio.Lock()
        self._sock: socket.socket | None = None
        self._ack = bytearray(ACK_SIZE)
        self._commit_out = False  # a frame carrying the commit started going out in this stage
        self.secret = kv_auth.deployment_secret()  # proves us to the receiver (`kv_auth`); None: no handshake

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
            async with asyncio.timeout(self.limits.connect_timeout_s):
                await loop.sock_connect(sock, sockaddr)
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise DestinationGone(f"cannot connect to KV receiver {self.address}: {exc!r}") from exc
        self._sock = sock
        if self.secret is not None:
            await self._authenticate(loop)

    async def _authenticate(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answer the receiver's challenge (`kv_auth`) before the first frame."""
        try:
            async with asyncio.timeout(self.limits.connect_timeout_s):
                nonce = kv_auth.nonce_of(await self._recv_exactly(kv_auth.MESSAGE_SIZE))
                await loop.sock_sendall(self._sock, kv_auth.proof(self.secret, nonce))
        except (TimeoutError, OSError, ValueError, EOFError) as exc:
            self.close()
            raise DestinationGone(f"KV receiver {self.address} did not authenticate us: {exc!r}") from exc

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def send_stage(self, migration_id: str, stage: int, lease_offset: int, block_ids: Sequence[int],
                         copier: BlockCopier, checksum: Checksum, between_frames: Callable[[], None],
                         commit: bytes = b"", tokens: TokenRun | None = None,
                         head: TokenRun | None = None) -> StageTransfer:
        """Ship the blocks as frames (`head` as token frames before them, `tokens` after) and
        wait for every ack. `between_frames` raises to stop
        early (the request is gone). Any failure closes the connection (its framing state is
        unknown) and raises a MigrationFailed subclass.

        With `commit` (an encoded `MigrationCommit`: the last stage), the last frame (an empty
        one if there are no blocks) carries it: returns with `committed` once the destination
        committed, raises DestinationRefused when it surely did not (its ack said so), and
        CommitOutcomeUnknown when the commit may have gone out but no ack came back."""
        loop = asyncio.get_running_loop()
        frame_bytes = self.limits.effective_frame_bytes()
        chunks: list[Chunk] = list(frame_chunks(block_ids, copier.block_bytes, frame_bytes))
        total = copier.frame_bytes(len(block_ids))
        def by_token(run: TokenRun | None) -> list[Chunk]:
            if run is None or not run.num_tokens:
                return []
            if not copier.token_bytes:
                raise ValueError("token frames need a KV layout with token slots")
            return [(run, chunk) for chunk in token_chunks(run.start, run.stop, copier.token_bytes, frame_bytes)]

        before, after = by_token(head), by_token(tokens)
        if before or after:
            chunks = before + [c for c in chunks if c] + after
            total += sum(copier.token_frame_bytes(run.num_tokens) for run in (head, tokens) if run is not None)
        started = loop.time()
        self._commit_out = False
        try:
            async with asyncio.timeout(self.limits.stage_timeout_s(total)):
                if self._sock is None:
                    await self.connect()
                await self._send_frames(migration_id, stage, lease_offset, chunks, copier, checksum, between_frames,
                                        commit)
                last = await self._read_acks(migration_id, len(chunks))
        except DestinationRefused:
            raise  # (every ack was read: the connection goes on; a refused commit is definite)
        except BaseException as exc:
            self.close()  # its framing state is unknown (stopped or cut mid-frame, acks unread)
            failure = self._failure(exc, stage)
            if failure is exc:
                raise
            raise failure from exc
        if commit and last.status is not AckStatus.COMMITTED:  # (a receiver that ignored the commit)
            raise DestinationRefused(f"commit not acknowledged: {last.status.name}")
        return StageTransfer(len(block_ids), total, len(chunks), loop.time() - started, bool(commit))

    def _failure(self, exc: BaseException, stage: int) -> BaseException:
        """What a stage that broke off with `exc` raises."""
        if self._commit_out and not isinstance(exc, asyncio.CancelledError):
            return CommitOutcomeUnknown(f"commit in stage {stage} to {self.address}: no ack ({exc!r})")
        if isinstance(exc, MigrationFailed) or not isinstance(exc, Exception):
            return exc
        if isinstance(exc, TimeoutError):
            return DestinationSlow(f"stage {stage} to {self.address} timed out")
        if isinstance(exc, (OSError, FrameError, EOFError)):
            return DestinationGone(f"KV connection to {self.address} failed: {exc!r}")
        return exc

    async def _send_frames(self, migration_id: str, stage: int, lease_offset: int, chunks: list[Chunk],
                           copier: BlockCopier, checksum: Checksum, between_frames: Callable[[], None],
                           commit: bytes) -> None:
        """Block frames are lists of block ids; token frames (run, (start, stop)) tuples."""
        loop, sock = asyncio.get_running_loop(), self._sock

        async def gather(chunk: list[int], slot: int) -> list[memoryview]:
            return [await copier.gather(chunk, slot)]

        def prepare(chunk: Chunk, slot: int) -> asyncio.Future:
            if isinstance(chunk, tuple):  # a few token slots: gathered here and now
                (run, (start, stop)) = chunk
                views = [copier.gather_tokens(run.table, start, stop, slot)]
            else:
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
                self._commit_out = bool(carried)  # from its first byte on, the destination may commit
                if isinstance(chunk, tuple):
                    start, stop = chunk[1]
                    header = FrameHeader(migration_id, stage, start, stop - start, nbytes, commit_len=len(carried),
                                         tokens=True)
                else:
                    header = FrameHeader(migration_id, stage, offset, len(chunk), nbytes, commit_len=len(carried))
                    offset += len(chunk)
                await send_frame(loop, sock, header, views, checksum, carried)
                sent += nbytes
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    async def _read_acks(self, migration_id: str, count: int) -> FrameAck:
        """Every ack of the stage; returns the last. Raises DestinationRefused (after reading
        them all: the connection goes on) if one is an error."""
        refused: FrameAck | None = None
        for _ in range(count):
            ack, detail_len = FrameAck.unpack_fixed(await self._recv_exactly(ACK_SIZE))
            if detail_len:
                detail = bytes(await self._recv_exactly(detail_len)).decode("utf-8", "replace")
                ack = dataclasses.replace(ack, detail=detail)
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
                         between_frames: Callable[[], None] = lambda: None, commit: bytes = b"",
                         tokens: TokenRun | None = None, head: TokenRun | None = None) -> StageTransfer:
        """See `KVConnection.send_stage` (`commit`: the last frame carries the COMMIT; `head` and
        `tokens`: token frames before and after the blocks)."""
        connection = self.connection(address)
        async with connection.lock:
            return await connection.send_stage(migration_id, stage, lease_offset, block_ids, copier, self.checksum,
                                               between_frames, commit, tokens, head)

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
