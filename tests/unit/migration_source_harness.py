"""The source coordinator's test harness: a real destination registry and loopback KV receiver,
the handshake called directly (no NATS) so that faults can be injected at any step. Used by
test_migration_source*.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from services.llumlet.engines.sim.engine import SimEngine
from shared.engine_model.request import RequestStatus
from services.llumlet.migration import kv_sender
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.ops import KVRegion
from services.llumlet.migration.destination import IncomingMigrations
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.protocol import (
    DestinationGone,
    DestinationSlow,
    MigrationLimits,
    MigrationStatus,
    PreAllocGrant,
)
from services.llumlet.migration.source import MigrationCoordinator
from shared.messages import Ack, MigrationAbort, MigrationCommit, PreAlloc
from tests.unit.migration_helpers import gen, sim_config

TIME_SCALE = 0.01  # a decode step is ~0.3 ms: a request keeps decoding while stages run




class DirectLink:
    """The handshake as direct calls on the destination's registry, with hooks to inject faults
    or delays before a call reaches it (`before[verb](msg)`)."""

    def __init__(self, incoming: IncomingMigrations, on_committed: Callable[[MigrationCommit], None]) -> None:
        self.incoming = incoming
        self.on_committed = on_committed
        self.before: dict[str, Callable[[object], Awaitable[None]]] = {}
        self.calls: list[str] = []

    async def _enter(self, verb: str, msg) -> None:
        self.calls.append(verb)
        if verb in self.before:
            await self.before[verb](msg)

    async def prealloc(self, dst: str, msg: PreAlloc) -> PreAllocGrant:
        await self._enter("prealloc", msg)
        return await self.incoming.handle_prealloc(msg)

    async def abort(self, dst: str, msg: MigrationAbort) -> Ack:
        await self._enter("abort", msg)
        return self.incoming.handle_abort(msg)

    async def commit(self, dst: str, msg: MigrationCommit) -> Ack:
        await self._enter("commit", msg)
        ack, committed = self.incoming.handle_commit(msg)
        if committed:
            self.on_committed(msg)
        return ack


class Hooks:
    def __init__(self) -> None:
        self.migrated_out_ids: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self.resumes = 0

    def migrated_out(self, request_id: str) -> None:
        self.migrated_out_ids.append(request_id)

    def resumed(self) -> None:
        self.resumes += 1

    def changed(self) -> None:
        pass

    async def fail_request(self, request_id: str, reason: str) -> None:
        self.failed.append((request_id, reason))


class Harness:
    """A source and a destination engine, each stepped by a background loop like a llumlet's."""

    def __init__(self, limits: MigrationLimits, whole_blocks: bool = False, **engine_overrides) -> None:
        """`whole_blocks`: copiers that do not know the token dimension (as device memory here),
        so every frame carries whole blocks."""
        self.limits = limits
        config = sim_config(time_scale=TIME_SCALE, num_blocks=256, max_model_len=2048, **engine_overrides)
        self.src, self.dst = SimEngine(config), SimEngine(config)
        self.src_ops, self.dst_ops = self.src.migration_ops(), self.dst.migration_ops()

        def copier(ops) -> BlockCopier:
            regions = ops.kv_regions()
            return BlockCopier([KVRegion(r.tensor, r.block_dim) for r in regions] if whole_blocks else regions)

        self.src_copier, self.dst_copier = copier(self.src_ops), copier(self.dst_ops)
        self.incoming = IncomingMigrations(self.dst_ops, self.dst_copier, limits)
        self.receiver = KVReceiver(self.incoming, limits, self.dst_copier.new_host_buffer)
        self.senders = KVSenderPool(limits)
        self.link = DirectLink(self.incoming, lambda commit: None)
        self.hooks = Hooks()
        self.coordinator = MigrationCoordinator("src", self.src_ops, self.src_copier, self.link, self.senders,
                                                limits, self.hooks)
        self.outputs: dict[str, list] = {"src": [], "dst": []}
        self._loops: list[asyncio.Task] = []

    async def start(self) -> None:
        self.incoming.kv_address = await self.receiver.start()
        self._loops = [asyncio.create_task(self._step(name, engine)) for name, engine in (("src", self.src), ("dst", self.dst))]

    async def _step(self, name: str, engine: SimEngine) -> None:
        while True:
            if engine.has_work():
                self.outputs[name] += await engine.step()
            else:
                await asyncio.sleep(0.0005)

    async def close(self) -> None:
        await self.coordinator.stop()
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self.senders.close()
        await self.receiver.close()
        self.src_copier.close()
        self.dst_copier.close()

    async def decoding(self, request_id: str, prompt: int = 40, max_tokens: int = 400, min_output: int = 5) -> None:
        self.src.add_request(gen(request_id, prompt, max_tokens))
        async with asyncio.timeout(5):
            while self.src.get_request(request_id).num_output_tokens < min_output:
                await asyncio.sleep(0.001)

    async def wait_finished(self, request_id: str) -> None:
        async with asyncio.timeout(10):
            while self.src.get_request(request_id) is not None or self.dst.get_request(request_id) is not None:
                await asyncio.sleep(0.002)

    def stream(self, request_id: str) -> list[int]:
        """The tokens a client would see: the source's until the hand-over, then the
        destination's (ordered by index, duplicates dropped, as the gateway does)."""
        by_index: dict[int, int] = {}
        for name in ("src", "dst"):
            for output in self.outputs[name]:
                if output.request_id == request_id:
                    for i, token in enumerate(output.token_ids):
                        assert by_index.setdefault(output.start_index + i, token) == token
        assert sorted(by_index) == list(range(len(by_index))), "a gap in the stream"
        return [by_index[i] for i in range(len(by_index))]

    def assert_blocks_back(self) -> None:
        for engine in (self.src, self.dst):
            engine.scheduler.check_invariants()
            assert engine.num_free_blocks() == engine.num_blocks_total
            assert engine.num_reserved_blocks() == 0


@pytest.fixture
async def make_harness():
    made: list[Harness] = []

    async def make(limits: MigrationLimits = MigrationLimits(), whole_blocks: bool = False,
                   **engine_overrides) -> Harness:
        harness = Harness(limits, whole_blocks, **engine_overrides)
        await harness.start()
        made.append(harness)
        return harness

    yield make
    for harness in made:
        await harness.close()


def steps_later(engine: SimEngine, request_id: str, tokens: int) -> Callable[[object], Awaitable[None]]:
    """A handshake delay: wait until the request has produced `tokens` more tokens."""

    async def wait(msg) -> None:
        request = engine.get_request(request_id)
        if request is None:
            return
        target = request.num_output_tokens + tokens
        async with asyncio.timeout(5):
            while (r := engine.get_request(request_id)) is not None and r.num_output_tokens < target and r.status is RequestStatus.RUNNING:
                await asyncio.sleep(0.0005)

    return wait


# -- fault injection on the commit path (faults and commit tests) --------------------------------


def count_adds(h: Harness) -> list[str]:
    """Every add_migrated on the destination (a request must be added exactly once)."""
    added: list[str] = []
    real_add = h.dst_ops.add_migrated

    def add(commit, lease_id):
        added.append(commit.request.request_id)
        return real_add(commit, lease_id)

    h.dst_ops.add_migrated = add
    return added


def lose_the_commit_ack(h: Harness) -> None:
    """The destination commits the frame's commit, then the connection drops: its ack is lost."""
    real_commit_frame = h.incoming.commit_frame

    async def commit_then_lose_the_connection(header, raw, frame_status):
        answer = await real_commit_frame(header, raw, frame_status)
        h.receiver.drop_connections()  # the ack never leaves
        return answer

    h.incoming.commit_frame = commit_then_lose_the_connection


def cut_the_commit_frame(monkeypatch) -> None:
    """The sender hangs up right after the commit frame's header (the destination sees a
    truncated frame and aborts the migration); plain frames go out whole."""
    real_send_frame = kv_sender.send_frame

    async def send_or_cut(loop, sock, header, views, checksum, commit=b""):
        if not header.commit_len:
            return await real_send_frame(loop, sock, header, views, checksum, commit)
        sock.send(header.pack())
        raise ConnectionResetError("cut mid-frame")

    monkeypatch.setattr(kv_sender, "send_frame", send_or_cut)
