"""The KV data plane authenticated (issue 15, point 4): a real llumlet's receiver, given the
deployment's KV secret, drops every connection that does not prove it holds the secret before a
byte is read as a frame, and counts it; a peer with the proof gets its frame into a lease."""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from pathlib import Path

import nats
import pytest

from services.llumlet.migration import kv_auth
from services.llumlet.migration.kv_wire import ACK_SIZE, AckStatus, FrameAck, FrameHeader
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import LoadReport, PreAlloc, PreAllocReply, decode, encode
from tests.support.cluster import Cluster, free_port

SECRET = "test-kv-secret-" + uuid.uuid4().hex
BLOCK_BYTES = 16 * 64  # block size 16 x --sim-kv-bytes-per-token 64
REJECTED = "corral:kv_rejected_connections_total"


@pytest.fixture(scope="module")
def llumlet(tiny_model_dir, tmp_path_factory):
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path_factory.mktemp("kv-auth"))
    port = free_port()
    proc = cluster.spawn("kv-0", "llumlet", "--instance-id", "kv-0", "--engine", "sim", "--model", str(tiny_model_dir),
                         "--sim-kv-bytes-per-token", "64", "--metrics-port", str(port), "--sim-num-blocks", "256",
                         env={kv_auth.ENV_SECRET: SECRET})
    try:
        yield server.url, port, proc
    finally:
        cluster.stop()
        server.stop()


async def _kv_address(url: str) -> str:
    nc = await nats.connect(url)
    found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_report(msg) -> None:
        report = decode(msg.data, LoadReport)
        if report.kv_address and not found.done():
            found.set_result(report.kv_address)

    await nc.subscribe(subjects.load_report("kv-0"), cb=on_report)
    try:
        return await asyncio.wait_for(found, 60)
    finally:
        await nc.close()


async def _lease(url: str, num_blocks: int) -> str:
    migration_id = uuid.uuid4().hex
    nc = await nats.connect(url)
    try:
        reply = await nc.request(subjects.migration("kv-0", "prealloc"),
                                 encode(PreAlloc(migration_id, "r-" + migration_id, num_blocks, 30.0, 0)), timeout=5)
        grant = decode(reply.data, PreAllocReply)
        assert grant.ok and len(grant.block_ids) == num_blocks, grant
    finally:
        await nc.close()
    return migration_id


def _frame(migration_id: str, num_blocks: int) -> bytes:
    payload = bytes(range(256)) * (num_blocks * BLOCK_BYTES // 256)
    header = FrameHeader(migration_id, 0, 0, num_blocks, len(payload))
    return header.pack() + payload + zlib.crc32(payload).to_bytes(4, "big")


def _metric(port: int, reason: str) -> float:
    import httpx

    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(REJECTED) and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _exchange(address: str, first: bytes | None, frame: bytes) -> bytes:
    """Connect, read the challenge, send `first` (a proof; None: none), then the frame; return
    what came back before the receiver closed (or 2 s passed)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        challenge = await asyncio.wait_for(reader.readexactly(kv_auth.MESSAGE_SIZE), 5)
        if first is not None:
            writer.write(first(kv_auth.nonce_of(challenge)))
        writer.write(frame)
        await writer.drain()
    except ConnectionError:
        pass
    try:
        return await asyncio.wait_for(reader.read(ACK_SIZE), 2)
    except ConnectionError:  # reset: closed with our bytes unread
        return b""
    except asyncio.TimeoutError:
        return b"(open)"
    finally:
        writer.close()


async def test_a_frame_without_the_secret_changes_nothing_and_is_counted(llumlet):
    url, metrics_port, proc = llumlet
    address = await _kv_address(url)
    migration_id = await _lease(url, 2)  # a lease the frame would fit: only the proof is missing
    before = _metric(metrics_port, "bad_proof")
    unproven = await _exchange(address, None, _frame(migration_id, 2))
    assert unproven == b"", unproven  # closed without an ack: nothing was read as a frame
    forged = await _exchange(address, lambda nonce: kv_auth.proof(b"guessed", nonce), _frame(migration_id, 2))
    assert forged == b""
    assert _metric(metrics_port, "bad_proof") == before + 2
    # The same frame from a peer with the secret lands at lease offset 0: nothing was written before.
    proven = await _exchange(address, lambda nonce: kv_auth.proof(SECRET.encode(), nonce), _frame(migration_id, 2))
    ack = FrameAck.unpack(proven)
    assert ack.status is AckStatus.OK and ack.migration_id == migration_id
    assert proc.alive()


async def test_huge_frame_headers_from_strangers_allocate_nothing(llumlet):
    # was: two connections declaring 256 MiB frames took a llumlet from 62 to 585 MB
    url, metrics_port, proc = llumlet
    address = await _kv_address(url)
    rss_before = _rss_mb(proc.process.pid)
    header = FrameHeader(str(uuid.uuid4()), 0, 0, 1, 256 << 20).pack()
    results = await asyncio.gather(*(_exchange(address, None, header + b"\0" * 65536) for _ in range(2)))
    assert results == [b"", b""]
    time.sleep(0.5)
    assert _rss_mb(proc.process.pid) < rss_before + 32


async def test_a_silent_connection_is_dropped_after_the_handshake_timeout(llumlet):
    url, metrics_port, _ = llumlet
    address = await _kv_address(url)
    before = _metric(metrics_port, "timeout")
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await reader.readexactly(kv_auth.MESSAGE_SIZE)
    assert await asyncio.wait_for(reader.read(1), 10) == b""  # closed by the receiver
    writer.close()
    assert _metric(metrics_port, "timeout") == before + 1
