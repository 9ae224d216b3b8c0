"""The gateway's control channel: heartbeats and aborts from a thread of their own, on a real
nats-server. An abort handed over reaches the bus even while the gateway's own loop is blocked;
one handed over before the channel is connected is refused (the caller sends it the ordinary way)."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.gateway.control_channel import ControlChannel
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import AbortRequest, decode
from tests.chaos.harness import AbortClock


@pytest.fixture(scope="module")
def nats_url():
    server = start_nats()
    yield server.url
    server.stop()


async def wait_connected(channel: ControlChannel, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not channel.abort("probe-before-connect", "test"):
        assert time.monotonic() < deadline, "the control channel never connected"
        await asyncio.sleep(0.02)


async def test_aborts_reach_the_bus_while_the_main_loop_is_blocked_and_heartbeats_keep_beating(nats_url):
    channel = ControlChannel(nats_url, "gw-ctl", interval_s=0.05)
    assert not channel.abort("r-early", "too early")  # not started: refused, never lost silently
    with AbortClock(nats_url) as clock:  # (times the bus on a thread of its own)
        channel.start()
        try:
            await wait_connected(channel)
            beats_before = len(clock.beats)
            handed_at = time.monotonic()
            assert channel.abort("r-1", "client disconnected")
            time.sleep(0.5)  # this loop blocked, as a busy gateway's: the channel's thread goes on
            assert "r-1" in clock.seen and clock.seen["r-1"] - handed_at < 0.25
            assert len(clock.beats) - beats_before >= 5  # beating all along
        finally:
            await asyncio.to_thread(channel.stop)
    assert not channel.abort("r-late", "after stop")


async def test_stop_sends_the_aborts_still_queued(nats_url):
    seen: list[str] = []
    watcher = await nats.connect(nats_url)

    async def on_abort(msg) -> None:
        seen.append(decode(msg.data, AbortRequest).request_id)

    await watcher.subscribe(subjects.ABORT_ALL, cb=on_abort)
    await watcher.flush()
    channel = ControlChannel(nats_url, "gw-stop")
    channel.start()
    await wait_connected(channel)
    ids = [f"r-{i}" for i in range(200)]
    for request_id in ids:
        assert channel.abort(request_id, "gateway stopping")
    await asyncio.to_thread(channel.stop)
    deadline = time.monotonic() + 5
    while not set(ids) <= set(seen) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert set(ids) <= set(seen)
    await watcher.close()
