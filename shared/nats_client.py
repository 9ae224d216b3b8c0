"""NATS connection helper with the settings a long-running service wants."""

from __future__ import annotations

import logging
import math
import random

import nats
from nats.aio.client import Client
from nats.aio.client import Server as NatsServer
from nats.aio.msg import Msg

from shared import nats_auth
from shared.cancellation import keeping_cancellation

log = logging.getLogger(__name__)


# Reconnect backoff: a server not tried since the last success is tried at once (a cluster node
# gone: move to another now); each further failed try waits twice as long, up to the cap, with
# jitter so that a fleet reconnecting to a restarted server does not arrive in one wave. The cap
# keeps the time from NATS coming back to every service reconnected under ~1.5 s.
RECONNECT_FIRST_WAIT_S = 0.1
RECONNECT_MAX_WAIT_S = 1.0
_DOUBLINGS_TO_CAP = math.ceil(math.log2(RECONNECT_MAX_WAIT_S / RECONNECT_FIRST_WAIT_S))


def server_urls(url: str) -> list[str]:
    """Several servers of one cluster, comma-separated (`--nats-url a:4222,b:4222`)."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise ValueError(f"no NATS server URL in {url!r}")
    return urls


def reconnect_wait_s(failed_tries: int, rng: random.Random | None = None) -> float:
    """How long to wait before another try at a server that failed `failed_tries` times in a row."""
    if failed_tries <= 0:
        return 0.0
    # The doubling stops at the cap: 0.1 s * 2**1024 does not fit a float, and an exception here
    # makes nats-py retry at once, in a loop that logs without end (a two-hour outage did that).
    doublings = min(failed_tries - 1, _DOUBLINGS_TO_CAP)
    base = min(RECONNECT_MAX_WAIT_S, RECONNECT_FIRST_WAIT_S * 2**doublings)
    return base * (rng or random).uniform(0.5, 1.5)


def _next_server(servers: list[NatsServer], _info: dict) -> tuple[NatsServer, float]:
    """nats-py's reconnect handler: the server that failed least lately (ties at random)."""
    least = min(s.reconnects for s in servers)
    chosen = random.choice([s for s in servers if s.reconnects == least])
    return chosen, reconnect_wait_s(chosen.reconnects)


async def connect(url: str, name: str) -> Client:
    """Connect with unlimited reconnects; load reports serve as our own heartbeats. `url` may
    name several servers of a cluster, comma-separated."""

    async def on_disconnect() -> None:
        log.warning("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to NATS", name)

    async def on_error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    return await nats.connect(
        servers=server_urls(url),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,  # unused: `_next_server` decides the wait
        reconnect_to_server_handler=_next_server,
        ping_interval=10,
        max_outstanding_pings=3,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        **nats_auth.client_options(),  # credentials and TLS (--nats-creds, --nats-tls-*)
    )


async def flush_in_order(nc: Client, timeout_s: float = 5.0) -> None:
    """Return once the server has processed everything sent on `nc` so far (a subscription made
    just now included). nats-py's `flush` writes its PING ahead of commands still waiting for
    the client's flusher task, so its PONG can come back before a SUB queued just before it has
    reached the server; a second PING goes out after that SUB on the wire, and its PONG proves it."""
    await nc.flush(timeout=timeout_s)
    await nc.flush(timeout=timeout_s)


async def request(nc: Client, subject: str, payload: bytes, timeout_s: float,
                  headers: dict[str, str] | None = None) -> Msg:
    """`nc.request` without losing a cancellation that arrives with the reply (nats-py waits for
    it with `asyncio.wait_for`: `shared/cancellation.py`). Raises as `nc.request` does."""
    return await keeping_cancellation(nc.request(subject, payload, timeout=timeout_s, headers=headers))
