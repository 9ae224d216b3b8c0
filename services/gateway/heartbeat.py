"""The gateway's heartbeat: llumlets abort the requests of a gateway gone silent
(services/llumlet/gateway_watch.py), so a killed gateway leaves no orphan decoding."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client

from shared import subjects
from shared.messages import GatewayHeartbeat, encode

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.25


async def beat(nc: Client, gateway_id: str, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
    """Publish this gateway's heartbeat every `interval_s`, forever (cancel to stop)."""
    subject = subjects.gateway_heartbeat(gateway_id)
    payload = encode(GatewayHeartbeat(gateway_id, interval_s))
    while True:
        if nc.is_connected:
            try:
                await nc.publish(subject, payload)
            except Exception as exc:  # (NATS away) the next beat tries again
                log.debug("gateway heartbeat not sent: %s", exc)
        await asyncio.sleep(interval_s)
