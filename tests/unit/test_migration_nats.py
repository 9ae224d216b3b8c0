"""Two llumlets with simulated engines in one event loop, over a real nats-server: the whole
protocol (NATS handshake + TCP data plane) and the llumlet's wiring (orders, reports, output
hand-over, shutdown)."""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest

from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from services.llumlet.service import Llumlet
from shared import subjects
from shared.messages import AbortRequest, Ack, FinishReason, GenerateRequest, MigrateOrder, TokenChunk, decode, encode
from tests.unit.migration_helpers import expected_tokens, gen, sim_config, verify_kv

TIME_SCALE = 0.01
# Stage 0 of a 1200-token request takes ~2.5 s at this rate: faults can land mid-stage.
SLOW = MigrationLimits(bandwidth_bytes_per_s=0.5e6, lease_s=1.0, watchdog_interval_s=0.05)
SLOW_DECODE = dict(time_scale=0.05)  # ~1.5 ms per decode step


class Client:
    """A stand-in gateway: one output subject, streams reassembled by token index."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.subject = f"test.out.{uuid.uuid4().hex[:8]}"
        self.chunks: list[TokenChunk] = []

    async def start(self) -> Client:
        async def on_chunk(msg) -> None:
            self.chunks.append(decode(msg.data, TokenChunk))

        await self.nc.subscribe(self.subject, cb=on_chunk)
        return self

    async def submit(self, llumlet: Llumlet, request: GenerateRequest) -> None:
        request.reply_subject = self.subject
        reply = await self.nc.request(subjects.llumlet(llumlet.instance_id, "generate"), encode(request), timeout=2)
        ack = decode(reply.data, Ack)
        assert ack.ok, ack

    def of(self, request_id: str) -> list[TokenChunk]:
        return [c for c in self.chunks if c.request_id == request_id]

    def finished(self, request_id: str) -> bool:
        return any(c.finish_reason is not None for c in self.of(request_id))

    def tokens(self, request_id: str) -> list[int]:
        """Ordered by index; a duplicate must repeat the same token, and there is no gap."""
        by_index: dict[int, int] = {}
        for chunk in self.of(request_id):
            for i, token in enumerate(chunk.token_ids):
                assert by_index.setdefault(chunk.start_index + i, token) == token, "conflicting duplicate"
        assert sorted(by_index) == list(range(len(by_index))), "gap in the stream"
        return [by_index[i] for i in range(len(by_index))]

    def publishers(self, request_id: str) -> list[str]:
        """Who published new tokens, in arrival order. A chunk that brings nothing new is
        skipped, as the gateway skips it: the source's last chunk may arrive after the
        destination's catch-up (the COMMIT travels over TCP, not behind it on NATS)."""
        seen: list[str] = []
        indexes: set[int] = set()
        for chunk in self.of(request_id):
            new = set(range(chunk.start_index, chunk.start_index + len(chunk.token_ids))) - indexes
            indexes |= new
            if new and (not seen or seen[-1] != chunk.instance_id):
                seen.append(chunk.instance_id)
        return seen

    async def wait_finished(self, request_id: str, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not self.finished(request_id):
                await asyncio.sleep(0.005)


@pytest.fixture
async def nc(nats_url):
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
async def client(nc) -> Client:
    return await Client(nc).start()


@pytest.fixture
async def llumlets(nats_url):
    made: list[Llumlet] = []

    async def make(limits: MigrationLimits = MigrationLimits(), **engine) -> Llumlet:
        instance_id = f"mig-{uuid.uuid4().hex[:6]}"
        # No stop grace: a stop here hands its requests back at once (the grace's live migration
        # out is the drain tests' subject).
        config = LlumletConfig(instance_id, nats_url, migration=limits, report_interval_s=0.05, stop_grace_s=0.0)
        options = dict(time_scale=TIME_SCALE, num_blocks=400, block_size=16, max_model_len=4096,
                       kv_bytes_per_token=1024)
        llumlet = Llumlet(config, SimEngine(sim_config(**{**options, **engine})))
        await llumlet.start()
        made.append(llumlet)
        return llumlet

    yield make
    for llumlet in made:
        if llumlet.nc is not None and not llumlet.nc.is_closed:
            await llumlet.stop()


async def decoding(llumlet: Llumlet, client: Client, request_id: str, prompt: int, max_tokens: int, min_output: int = 5):
    await client.submit(llumlet, gen(request_id, prompt, max_tokens))
    async with asyncio.timeout(5):
        while len(client.tokens(request_id)) < min_output:
            await asyncio.sleep(0.002)


def assert_idle(*llumlets: Llumlet) -> None:
    for llumlet in llumlets:
        engine = llumlet.engine
        engine.scheduler.check_invariants()
        assert engine.num_free_blocks() == engine.num_blocks_total, llumlet.instance_id
        assert engine.num_reserved_blocks() == 0


async def wait_idle(*llumlets: Llumlet, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while any(l.engine.num_free_blocks() != l.engine.num_blocks_total or l.engine.num_reserved_blocks()
                  for l in llumlets):
            await asyncio.sleep(0.01)
    assert_idle(*llumlets)


async def test_migrated_request_streams_exactly_its_own_tokens(llumlets, client) -> None:
    a, b = await llumlets(), await llumlets()
    await decoding(a, client, "r1", prompt=500, max_tokens=800)
    m = await a.migration.coordinator.migrate("r1", b.instance_id)
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert verify_kv(b.engine, "r1")
    await client.wait_finished("r1")
    assert client.tokens("r1") == expected_tokens(a.engine, "r1", 800)
    assert client.publishers("r1")[:2] == [a.instance_id, b.instance_id]
    assert client.of("r1")[-1].finish_reason is FinishReason.LENGTH
    assert {c.handover_from for c in client.of("r1") if c.handover} == {a.instance_id}  # (names its source)
    await wait_idle(a, b)


async def test_back_and_forth_several_times(llumlets, client) -> None:
    a, b = await llumlets(), await llumlets()
    await decoding(a, client, "ping", prompt=300, max_tokens=1500)
    holders = [a, b, a, b]
    for src, dst in zip(holders, holders[1:]):
        m = await src.migration.coordinator.migrate("ping", dst.instance_id)
        assert m.status is MigrationStatus.FINISHED, m.reason
        assert verify_kv(dst.engine, "ping")
        await asyncio.sleep(0.05)  # a few tokens on each instance
    await client.wait_finished("ping")
    assert client.tokens("ping") == expected_tokens(a.engine, "ping", 1500)
    assert client.publishers("ping") == [a.instance_id, b.instance_id, a.instance_id, b.instance_id]
    await wait_idle(a, b)


async def test_orders_keep_migrating_until_cancelled(llumlets, client, nc) -> None:
    young = MigrationLimits(min_residence_s=0)  # move requests at once (the guard has its own tests)
    a, b = await llumlets(young), await llumlets(young)
    for i in range(4):
        await client.submit(a, gen(f"o{i}", 200 + 50 * i, 3000))
    async with asyncio.timeout(5):
        while len(a.migration.ops.migration_candidates()) < 4:
            await asyncio.sleep(0.005)
    order = MigrateOrder("pair-1", b.instance_id)
    async with asyncio.timeout(10):
        while len(b.engine.request_views()) < 2:
            await nc.publish(subjects.llumlet(a.instance_id, "migrate"), encode(order))  # re-confirmed each round
            await asyncio.sleep(0.02)
    await nc.publish(subjects.llumlet(a.instance_id, "migrate"), encode(MigrateOrder("pair-1", b.instance_id, cancel=True)))
    await asyncio.sleep(0.2)
    moved = len(b.engine.request_views())
    await asyncio.sleep(0.3)
    assert len(b.engine.request_views()) == moved  # cancelled: nothing more moves
    assert a.migration.coordinator.history[0].request_id == "o0"  # the shortest first
    assert len(a.engine.request_views()) + moved == 4


async def test_report_carries_the_kv_address_and_reserved_blocks(llumlets, client) -> None:
    a, b = await llumlets(SLOW, **SLOW_DECODE), await llumlets(SLOW, **SLOW_DECODE)
    await decoding(a, client, "big", prompt=1200, max_tokens=3000)
    task = asyncio.create_task(a.migration.coordinator.migrate("big", b.instance_id))
    async with asyncio.timeout(5):
        while not b.engine.num_reserved_blocks():
            await asyncio.sleep(0.005)
    dst_report, src_report = b.reports.current_load(), a.reports.current_load()
    assert dst_report.kv_address == b.migration.kv_address and ":" in dst_report.kv_address
    assert dst_report.reserved_blocks >= 1200 // 16 and dst_report.num_migrating == 1
    assert src_report.num_migrating == 1
    await a.migration.coordinator.stop()  # aborts it: the reservation goes away at once
    assert (await task).status is MigrationStatus.ABORTED_SRC
    assert b.engine.num_reserved_blocks() == 0


async def test_destination_without_room_refuses_and_nothing_leaks(llumlets, client) -> None:
    a, b = await llumlets(), await llumlets(num_blocks=20)
    await decoding(a, client, "fat", prompt=800, max_tokens=300)
    m = await a.migration.coordinator.migrate("fat", b.instance_id)
    assert m.status is MigrationStatus.ABORTED_DST and "no room" in m.reason
    await client.wait_finished("fat")
    assert client.tokens("fat") == expected_tokens(a.engine, "fat", 300)
    assert client.publishers("fat") == [a.instance_id]
    await wait_idle(a, b)


async def test_a_draining_destination_refuses(llumlets, client) -> None:
    a, b = await llumlets(), await llumlets()
    b.draining = True
    await decoding(a, client, "d", prompt=300, max_tokens=300)
    m = await a.migration.coordinator.migrate("d", b.instance_id)
    assert m.status is MigrationStatus.ABORTED_DST and "draining" in m.reason
    await client.wait_finished("d")
    await wait_idle(a, b)


async def test_destination_stopping_mid_stage_leaves_the_request_on_the_source(llumlets, client) -> None:
    a, b = await llumlets(SLOW, **SLOW_DECODE), await llumlets(SLOW, **SLOW_DECODE)
    await decoding(a, client, "s", prompt=1200, max_tokens=800)
    task = asyncio.create_task(a.migration.coordinator.migrate("s", b.instance_id))
    async with asyncio.timeout(5):
        while not b.engine.num_reserved_blocks():
            await asyncio.sleep(0.005)
    await asyncio.sleep(0.1)  # mid-stage
    await b.stop()
    m = await task
    assert m.status is MigrationStatus.ABORTED_DST
    await client.wait_finished("s")
    assert client.tokens("s") == expected_tokens(a.engine, "s", 800)
    assert b.engine.num_reserved_blocks() == 0  # released when it stopped
    await wait_idle(a)


async def test_source_stopping_mid_stage_errors_the_request_and_frees_the_lease(llumlets, client) -> None:
    a, b = await llumlets(SLOW, **SLOW_DECODE), await llumlets(SLOW, **SLOW_DECODE)
    await decoding(a, client, "x", prompt=1200, max_tokens=3000)
    task = asyncio.create_task(a.migration.coordinator.migrate("x", b.instance_id))
    async with asyncio.timeout(5):
        while not b.engine.num_reserved_blocks():
            await asyncio.sleep(0.005)
    await a.stop()
    assert (await task).status is MigrationStatus.ABORTED_SRC
    await client.wait_finished("x")
    last = client.of("x")[-1]
    assert last.finish_reason is FinishReason.ERROR and "stopped" in last.error and last.instance_id == a.instance_id
    assert last.resumable  # the gateway resumes it elsewhere (issue 14)
    await wait_idle(b)  # the source's ABORT (or, failing that, the lease) freed the reservation


async def test_client_abort_during_migration_frees_both_sides(llumlets, client, nc) -> None:
    a, b = await llumlets(SLOW, **SLOW_DECODE), await llumlets(SLOW, **SLOW_DECODE)
    await decoding(a, client, "c", prompt=1200, max_tokens=3000)
    task = asyncio.create_task(a.migration.coordinator.migrate("c", b.instance_id))
    async with asyncio.timeout(5):
        while not b.engine.num_reserved_blocks():
            await asyncio.sleep(0.005)
    started = asyncio.get_running_loop().time()
    await nc.publish(subjects.ABORT_ALL, encode(AbortRequest("c")))
    m = await task
    assert m.status.is_over and m.status is not MigrationStatus.FINISHED
    assert asyncio.get_running_loop().time() - started < 0.5  # the stage stopped between frames
    await wait_idle(a, b)


async def test_stopping_publishes_an_error_for_every_request_held(llumlets, client) -> None:
    a, b = await llumlets(), await llumlets()
    await decoding(a, client, "moved", prompt=300, max_tokens=5000)
    await decoding(b, client, "native", prompt=300, max_tokens=5000)
    await decoding(a, client, "bystander", prompt=100, max_tokens=3000)  # on the instance that stays
    assert (await a.migration.coordinator.migrate("moved", b.instance_id)).status is MigrationStatus.FINISHED
    assert not client.finished("bystander")
    await b.stop()
    for request_id in ("moved", "native"):
        await client.wait_finished(request_id, 2)
        last = client.of(request_id)[-1]
        assert last.finish_reason is FinishReason.ERROR and last.instance_id == b.instance_id and last.resumable
    await client.wait_finished("bystander")  # untouched by b's stop: no error, its whole stream
    assert client.of("bystander")[-1].finish_reason is FinishReason.LENGTH
    assert client.tokens("bystander") == expected_tokens(a.engine, "bystander", 3000)
    assert client.publishers("bystander") == [a.instance_id]
    await wait_idle(a)
