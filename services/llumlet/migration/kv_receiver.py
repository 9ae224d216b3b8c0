"""The destination's side of the KV data plane: a TCP server with one `FrameConnection` per source
(`kv_connection`: reading, checksumming, scattering and acking frames) that hands verified frames
to a `FrameSink` (`kv_sink`; the incoming-migration registry implements it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

import numpy as np

from services.llumlet.migration import kv_auth
from services.llumlet.migration.kv_connection import FrameConnection
from services.llumlet.migration.kv_sink import FrameSink
from services.llumlet.migration.protocol import MigrationLimits

log = logging.getLogger(__name__)


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
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()

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
