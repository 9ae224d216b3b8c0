"""The gateway's heartbeat: llumlets abort the requests of a gateway gone silent
(services/llumlet/gateway_watch.py), so a killed gateway leaves no orphan decoding.

It says "this process is alive", not "its event loop is idle": it beats from a thread of its own,
on its own event loop and NATS connection, so a gateway whose main loop is saturated (thousands of
streams) keeps beating (the interpreter switches threads every few ms) while a killed or frozen
one stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from shared import subjects
from shared.messages import GatewayHeartbeat, encode
from shared.nats_client import connect

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.25


class Heartbeat:
    def __init__(self, nats_url: str, gateway_id: str, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._nats_url, self._gateway_id, self._interval_s = nats_url, gateway_id, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._beat()), name="gateway-heartbeat",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    async def _beat(self) -> None:
        subject = subjects.gateway_heartbeat(self._gateway_id)
        payload = encode(GatewayHeartbeat(self._gateway_id, self._interval_s))
        nc = await connect(self._nats_url, f"corral-gateway-{self._gateway_id}-heartbeat")
        try:
            while not self._stop.is_set():
                if nc.is_connected:
                    try:
                        await nc.publish(subject, payload)
                    except Exception as exc:  # (NATS away) the next beat tries again
                        log.debug("gateway heartbeat not sent: %s", exc)
                await asyncio.sleep(self._interval_s)
        finally:
            await nc.close()
