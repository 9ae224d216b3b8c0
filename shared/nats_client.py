"""NATS connection helper with the settings a long-running service wants."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)


async def connect(url: str, name: str) -> Client:
    """Connect with unlimited reconnects; load reports serve as our own heartbeats."""

    async def on_disconnect() -> None:
        log.warning("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to NATS", name)

    async def on_error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    return await nats.connect(
        servers=[url],
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=10,
        max_outstanding_pings=3,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )
