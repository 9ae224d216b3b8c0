"""The destination's side of the KV data plane: a TCP server with one `FrameConnection` per source
(`kv_connection`: reading, checksumming, scattering and acking frames), and the `FrameSink` it
hands verified frames to (the incoming-migration registry implements it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from services.llumlet.migration import kv_auth
from services.llumlet.migration.kv_connection import FrameConnection
from services.llumlet.migration.kv_wire import AckStatus, FrameHeader
from services.llumlet.migration.protocol import MigrationLimits

log = logging.getLogger(__name__)


class FrameSink(Protocol):
    """The destination's side of a frame (implemented by the incoming-migration registry)."""

    def admit(self, header: FrameHeader) -> AckStatus:
        """May this frame be written now? (migration running, next blocks of its lease, size)"""

    async def write(self, header: FrameHeader, payload: memoryview) -> AckStatus:
        """Scatter the (checksum-verified) payload into the lease's blocks."""

    def frame_failed(self, header: FrameHeader, status: AckStatus) -> None:
        """A frame of this migration was refused, corrupt or truncated: abort it."""

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
    """The destination's TCP server: one `FrameConnection` per source connection."""

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
        self._connections: set[FrameConnection] = set()
        self._workers: set[asyncio.Task] = set()  # one per connection; outlives it by its last frames
        # Peers must prove they hold it before any frame (`kv_auth`); None: no handshake.
        self.secret = kv_auth.deployment_secret()

    async def start(self) -> str:
        if self.secret is None:
            log.warning("KV receiver without a KV secret (CORRAL_KV_SECRET): any peer that reaches its port "
                        "may send frames")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FrameConnection(self), self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.advertise_host}:{port}"
        return self.address

    def drop_connections(self) -> None:
        """Close every source's connection (their frames in flight are TRUNCATED)."""
        for connection in list(self._connections):
            connection.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()
        for worker in list(self._workers):
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def attach(self, connection: FrameConnection, worker: asyncio.Task) -> None:
        """A source connected; `worker` acks its frames (and outlives it by its last ones)."""
        self._connections.add(connection)
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)

    def detach(self, connection: FrameConnection) -> None:
        self._connections.discard(connection)


def _reachable_host(bind_host: str) -> str:
    """What peers should dial: the bind address, or this host's address for a wildcard bind."""
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
