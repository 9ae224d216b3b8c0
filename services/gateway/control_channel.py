"""The gateway's control messages to the llumlets: its heartbeat and its clients' aborts.

Both go out from a thread of their own, on its own event loop and NATS connection, so neither
waits behind token output:

- The heartbeat says "this process is alive", not "its event loop is idle": llumlets abort the
  requests of a gateway gone silent (services/llumlet/gateway_watch.py), so a killed gateway
  leaves no orphan decoding, while one whose main loop is saturated (thousands of streams) keeps
  beating (the interpreter switches threads every few ms).
- An abort handed over here is on the bus within milliseconds. On the main loop it would wait
  for a task to start and for the NATS client's flusher, one full pass of that loop each, and a
  pass over thousands of streams takes hundreds of milliseconds under load.

Only aborts of requests the llumlet acknowledged may come here: this connection does not keep
order with the main one, so an abort sent here could overtake a generate order still in flight
there (the llumlet would ignore the abort, then run the request for nobody).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from nats.aio.client import Client

from shared import subjects
from shared.cancellation import wait_set
from shared.messages import AbortRequest, GatewayHeartbeat, encode
from shared.nats_client import connect

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.25
STOP_FLUSH_S = 1.0  # at stop, how long aborts still queued get to reach the bus


class ControlChannel:
    def __init__(self, nats_url: str, gateway_id: str, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._nats_url, self._gateway_id, self._interval_s = nats_url, gateway_id, interval_s
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="gateway-control",
                                        daemon=True)
        # Set by the thread once connected; read by the gateway's main thread.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc: Client | None = None
        self._aborts: asyncio.Queue[bytes] | None = None
        self._stopping: asyncio.Event | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Publish the aborts still queued, then close (blocking: call it from a worker thread)."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:
                pass  # its loop ended already (the connection failed)
        self._thread.join(timeout_s)

    def abort(self, request_id: str, reason: str) -> bool:
        """Queue an abort of an acknowledged request for the bus; False when this channel cannot
        take it now (not connected yet, NATS away, stopping): send it the ordinary way then."""
        loop, aborts, nc, stopping = self._loop, self._aborts, self._nc, self._stopping
        if loop is None or aborts is None or nc is None or stopping is None or not nc.is_connected or stopping.is_set():
            return False
        payload = encode(AbortRequest(request_id, reason, self._gateway_id))
        try:
            loop.call_soon_threadsafe(aborts.put_nowait, payload)
        except RuntimeError:
            return False  # its loop is closed
        return True

    async def _run(self) -> None:
        nc = await connect(self._nats_url, f"corral-gateway-{self._gateway_id}-control")
        self._aborts, self._stopping = asyncio.Queue(), asyncio.Event()
        self._nc, self._loop = nc, asyncio.get_running_loop()
        sending = asyncio.create_task(self._send_aborts(nc, self._aborts))
        try:
            await self._beat(nc, self._stopping)
        finally:
            await self._flush_aborts(nc, self._aborts)
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            await nc.close()

    async def _beat(self, nc: Client, stopping: asyncio.Event) -> None:
        subject = subjects.gateway_heartbeat(self._gateway_id)
        payload = encode(GatewayHeartbeat(self._gateway_id, self._interval_s))
        while not stopping.is_set():
            if nc.is_connected:
                try:
                    await nc.publish(subject, payload)
                except Exception as exc:  # (NATS away) the next beat tries again
                    log.debug("gateway heartbeat not sent: %s", exc)
            await wait_set(stopping, self._interval_s)

    async def _send_aborts(self, nc: Client, aborts: asyncio.Queue[bytes]) -> None:
        while True:
            payload = await aborts.get()
            await self._publish(nc, payload)

    async def _flush_aborts(self, nc: Client, aborts: asyncio.Queue[bytes]) -> None:
        while not aborts.empty():
            await self._publish(nc, aborts.get_nowait())
        if nc.is_connected:
            try:
                await nc.flush(timeout=STOP_FLUSH_S)
            except Exception as exc:
                log.warning("aborts not flushed at stop: %s", exc)

    @staticmethod
    async def _publish(nc: Client, payload: bytes) -> None:
        try:
            await nc.publish(subjects.ABORT_ALL, payload)
        except Exception as exc:  # buffered while NATS reconnects; past that buffer it is lost
            log.warning("could not publish an abort: %s", exc)
