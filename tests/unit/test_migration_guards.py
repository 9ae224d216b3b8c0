"""The llumlet's migration guards (the simulator's `MigrationGuard`, applied live) and the short
last stage: a request moves only after `min_residence_s` on its instance; a destination refuses
the first PRE-ALLOC while requests wait there or when the request would leave it short of free
blocks; the last stage is reserved before the suspend and its COMMIT rides in its last frame."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.destination import IncomingMigrations
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.kv_wire import AckStatus, FrameHeader
from services.llumlet.migration.leases import guard_refusal
from services.llumlet.migration.ops import IntakeLoad, LivePhase, MigrationSnapshot
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus, PreAllocGrant, new_migration_id
from services.llumlet.migration.source import MigrationCoordinator
from shared.messages import Ack, MigrateOrder, MigrationAbort, MigrationCommit, PreAlloc
from shared.policy.migration import MigrationCandidate
from tests.unit.migration_helpers import FakeClock, decode_steps, expected_tokens, export_kv, gen, sim_config, verify_kv

# -- residence (source) ---------------------------------------------------------------------------


class ResidenceOps:
    """Two decoding requests, the shorter one young; each PRE-ALLOC tells which one was picked."""

    block_size = 4

    def __init__(self, residence: dict[str, float]) -> None:
        self.residence = residence

    def migration_candidates(self) -> list[MigrationCandidate]:
        return [MigrationCandidate("old", 0, 400), MigrationCandidate("young", 0, 100)]

    def residence_s(self, request_id: str) -> float | None:
        return self.residence.get(request_id)

    def migration_snapshot(self, request_id: str) -> MigrationSnapshot:
        return MigrationSnapshot(LivePhase.RUNNING, 40, 0, 11)

    def prefix_block_hashes(self, request_id: str) -> list[int]:
        return []


class RefusingLink:
    """Refuses every PRE-ALLOC (the migration ends at once), remembering whose it was."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def prealloc(self, dst: str, msg: PreAlloc) -> PreAllocGrant:
        self.asked.append(msg.request_id)
        return PreAllocGrant(ok=False, reason="test")

    async def abort(self, dst: str, msg: MigrationAbort) -> Ack:
        return Ack(ok=True)


class NoHooks:
    def migrated_out(self, request_id: str) -> None: ...

    def resumed(self) -> None: ...

    def changed(self) -> None: ...

    async def fail_request(self, request_id: str, reason: str) -> None: ...


async def first_picks(residence: dict[str, float], min_residence_s: float, count: int) -> list[str]:
    """The requests the migrate-out loop picks, in order, while paired."""
    link = RefusingLink()
    limits = MigrationLimits(min_residence_s=min_residence_s, refused_backoff_s=0.01, idle_poll_s=0.005)
    coordinator = MigrationCoordinator("src", ResidenceOps(residence), None, link, None, limits, NoHooks())
    loop = asyncio.create_task(coordinator.run())
    try:
        coordinator.on_order(MigrateOrder("p", "dst"))
        async with asyncio.timeout(5):
            while len(link.asked) < count:
                await asyncio.sleep(0.002)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    return link.asked[:count]


async def test_a_young_request_is_not_picked_before_its_residence() -> None:
    assert await first_picks({"old": 5.0, "young": 0.2}, min_residence_s=1.0, count=3) == ["old"] * 3


async def test_without_the_residence_guard_the_shorter_request_goes_first() -> None:
    assert await first_picks({"old": 5.0, "young": 0.2}, min_residence_s=0.0, count=1) == ["young"]


async def test_a_request_of_unknown_residence_is_not_picked() -> None:
    assert await first_picks({"old": 5.0}, min_residence_s=1.0, count=2) == ["old", "old"]


async def test_sim_residence_counts_from_arrival_or_from_migrating_in() -> None:
    engine, other = SimEngine(sim_config()), SimEngine(sim_config())
    ops, other_ops = engine.migration_ops(), other.migration_ops()
    request = gen("r", 20, 100)
    request.arrival_time = time.time() - 5.0  # (as the gateway stamps it)
    other.add_request(request)
    await decode_steps(other, 3)
    assert 4.9 < other_ops.residence_s("r") < 6.0
    assert await other_ops.suspend("r")
    commit = other_ops.migration_commit("r", "m1")
    await ops.reserve_blocks("m1", len(other.block_ids_of("r")))
    ops.add_migrated(commit, "m1")
    assert 0.0 <= ops.residence_s("r") < 0.5  # since it migrated in, not since it arrived
    assert ops.residence_s("gone") is None


# -- intake (destination) -------------------------------------------------------------------------


def test_guard_refusal_is_the_simulators_rule() -> None:
    limits = MigrationLimits(dest_min_free_fraction=0.1, dest_max_waiting=0)
    assert guard_refusal(IntakeLoad(50, 100, 0), 40, limits) is None  # leaves 10 of 100
    short = guard_refusal(IntakeLoad(50, 100, 0), 41, limits)
    assert short is not None and short.startswith("no room")
    busy = guard_refusal(IntakeLoad(90, 100, 1), 1, limits)
    assert busy is not None and busy.startswith("busy")
    assert guard_refusal(IntakeLoad(90, 100, 2), 1, MigrationLimits(dest_max_waiting=2)) is None


class Intake:
    def __init__(self, load: IntakeLoad, limits: MigrationLimits = MigrationLimits(max_in=4)) -> None:
        self.engine = SimEngine(sim_config())  # 64 blocks
        self.ops = self.engine.migration_ops()
        self.copier = BlockCopier(self.ops.kv_regions())
        self.load = load
        self.incoming = IncomingMigrations(self.ops, self.copier, limits, clock=FakeClock(),
                                           intake_load=lambda: self.load)
        self.incoming.kv_address = "127.0.0.1:9"

    async def prealloc(self, mid: str, stage: int, num_blocks: int) -> PreAllocGrant:
        return await self.incoming.handle_prealloc(PreAlloc(mid, "r", num_blocks, 2.0, stage))


async def test_the_first_prealloc_is_refused_when_the_request_would_leave_too_little_free() -> None:
    intake = Intake(IntakeLoad(num_blocks_free=30, num_blocks_total=100, num_waiting=0))
    refused = await intake.prealloc(new_migration_id(), 0, 21)
    assert not refused.ok and refused.reason.startswith("no room")
    assert (await intake.prealloc(new_migration_id(), 0, 20)).ok
    assert intake.engine.num_reserved_blocks() == 20
    intake.copier.close()


async def test_the_first_prealloc_is_refused_while_requests_wait_here() -> None:
    intake = Intake(IntakeLoad(num_blocks_free=90, num_blocks_total=100, num_waiting=1))
    refused = await intake.prealloc(new_migration_id(), 0, 1)
    assert not refused.ok and refused.reason.startswith("busy")
    assert intake.engine.num_reserved_blocks() == 0
    intake.copier.close()


async def test_every_stage_of_an_admitted_migration_passes_the_guard_again() -> None:
    """One guard for every reservation (issue 15: a 1-block first stage topped up later reserved a
    whole instance): a destination that became busy since refuses the next stage, which wastes the
    copy so far but never takes blocks its own queue needs (the source aborts; the request goes on
    there)."""
    intake = Intake(IntakeLoad(num_blocks_free=90, num_blocks_total=100, num_waiting=0))
    mid = new_migration_id()
    assert (await intake.prealloc(mid, 0, 5)).ok
    assert (await intake.prealloc(mid, 1, 2)).ok  # still room, nothing waiting
    intake.load = IntakeLoad(num_blocks_free=5, num_blocks_total=100, num_waiting=3)  # since then
    refused = await intake.prealloc(mid, 2, 2)
    assert not refused.ok and refused.reason.startswith("busy")
    intake.copier.close()


def test_adapters_report_their_intake_load() -> None:
    engine = SimEngine(sim_config(num_blocks=64, max_num_seqs=1))
    ops = engine.migration_ops()
    engine.add_request(gen("a", 20, 50))
    engine.add_request(gen("b", 20, 50))  # waits: one sequence at a time
    engine.scheduler.schedule()
    load = ops.intake_load()
    assert load == IntakeLoad(engine.num_free_blocks(), 64, 1)


# -- the last stage: reserved before the suspend, topped up, committed in its frame ------------


async def test_a_repeated_prealloc_with_more_blocks_tops_up_its_stage() -> None:
    intake = Intake(IntakeLoad(64, 64, 0))
    mid = new_migration_id()
    first = await intake.prealloc(mid, 0, 3)
    again = await intake.prealloc(mid, 0, 3)
    topped = await intake.prealloc(mid, 0, 5)
    assert first.ok and again.block_ids == first.block_ids
    assert topped.ok and topped.block_ids[:3] == first.block_ids and len(topped.block_ids) == 5
    assert intake.incoming.get(mid).block_ids == topped.block_ids
    assert (await intake.prealloc(mid, 1, 0)).ok
    late = await intake.prealloc(mid, 0, 6)  # stage 0 is over
    assert not late.ok and intake.engine.num_reserved_blocks() == 5
    intake.copier.close()


async def test_a_nats_commit_before_the_lease_is_filled_is_refused_and_ends_the_migration() -> None:
    """The NATS COMMIT (sent only when the last frame's ack was lost) may find the lease not yet
    written: it is refused and ends the migration (the source resumes the request), and a frame
    that lands afterwards is refused too, so the request never runs on both instances."""
    intake = Intake(IntakeLoad(64, 64, 0))
    source = SimEngine(sim_config())
    source.add_request(gen("r", 10, 100))
    await decode_steps(source, 4)
    assert await source.migration_ops().suspend("r")
    blocks = source.block_ids_of("r")
    mid = new_migration_id()
    assert (await intake.prealloc(mid, 0, len(blocks))).ok
    ack, committed = intake.incoming.handle_commit(source.migration_ops().migration_commit("r", mid))
    assert not ack.ok and "KV incomplete" in ack.error and not committed
    assert intake.engine.num_reserved_blocks() == 0
    payload = export_kv(source, blocks).reshape(-1)
    header = FrameHeader(mid, 0, 0, len(blocks), payload.nbytes, 0)
    assert await intake.incoming.write(header, memoryview(payload)) is AckStatus.UNKNOWN_MIGRATION
    intake.copier.close()


class RecordingLink:
    """The handshake called directly; it records each call (with the request's phase at a
    PRE-ALLOC)."""

    def __init__(self, incoming: IncomingMigrations, src: SimEngine, request_id: str) -> None:
        self.incoming, self.src, self.request_id = incoming, src, request_id
        self.events: list[tuple[str, LivePhase | None]] = []

    def _phase(self) -> LivePhase | None:
        snapshot = self.src.migration_ops().migration_snapshot(self.request_id)
        return snapshot.phase if snapshot else None

    async def prealloc(self, dst: str, msg: PreAlloc) -> PreAllocGrant:
        self.events.append(("prealloc", self._phase()))
        return await self.incoming.handle_prealloc(msg)

    async def abort(self, dst: str, msg: MigrationAbort) -> Ack:
        return self.incoming.handle_abort(msg)

    async def commit(self, dst: str, msg: MigrationCommit) -> Ack:
        self.events.append(("commit", None))
        return self.incoming.handle_commit(msg)[0]


@pytest.fixture
async def pair():
    """A source and a destination sim engine with a real KV receiver, each stepped in the
    background like a llumlet's engine loop."""
    config = sim_config(time_scale=0.01, num_blocks=256, max_model_len=2048)
    src, dst = SimEngine(config), SimEngine(config)
    src_ops, dst_ops = src.migration_ops(), dst.migration_ops()
    limits = MigrationLimits(last_stage_blocks=0)
    src_copier, dst_copier = BlockCopier(src_ops.kv_regions()), BlockCopier(dst_ops.kv_regions())
    incoming = IncomingMigrations(dst_ops, dst_copier, limits)
    receiver = KVReceiver(incoming, limits, dst_copier.new_host_buffer)
    incoming.kv_address = await receiver.start()
    senders = KVSenderPool(limits)
    link = RecordingLink(incoming, src, "r")
    coordinator = MigrationCoordinator("src", src_ops, src_copier, link, senders, limits, NoHooks())
    outputs: list = []

    async def step(engine: SimEngine) -> None:
        while True:
            if engine.has_work():
                outputs.extend(await engine.step())
            else:
                await asyncio.sleep(0.0005)

    loops = [asyncio.create_task(step(engine)) for engine in (src, dst)]
    yield src, dst, link, coordinator, outputs
    await coordinator.stop()
    for task in loops:
        task.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    senders.close()
    await receiver.close()
    src_copier.close()
    dst_copier.close()


async def test_the_last_stage_is_reserved_before_the_suspend_and_committed_in_its_frame(pair) -> None:
    src, dst, link, coordinator, outputs = pair
    src.add_request(gen("r", 100, 300))
    async with asyncio.timeout(5):
        while src.get_request("r").num_output_tokens < 5:
            await asyncio.sleep(0.001)
    m = await coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert m.commit_via == "frame" and m.committed_at is not None
    assert link.events[-1] == ("prealloc", LivePhase.RUNNING)  # the last stage's, before the suspend
    assert ("commit", None) not in link.events  # answered in the last frame's ack, not over NATS
    assert m.stages[-1].final and m.stages[-1].prealloc_s == 0.0  # no PRE-ALLOC in the downtime
    assert m.downtime_s == pytest.approx(m.committed_at - m.suspended_at)
    assert verify_kv(dst, "r")
    async with asyncio.timeout(10):
        while dst.get_request("r") is not None:
            await asyncio.sleep(0.002)
    by_index = {}
    for output in outputs:
        if output.request_id == "r":
            for i, token in enumerate(output.token_ids):
                assert by_index.setdefault(output.start_index + i, token) == token
    assert [by_index[i] for i in range(len(by_index))] == expected_tokens(src, "r", 300)
    for engine in (src, dst):
        assert engine.num_free_blocks() == engine.num_blocks_total and engine.num_reserved_blocks() == 0


def test_the_limits_refuse_bad_guard_settings() -> None:
    for bad in (dict(min_residence_s=-1), dict(dest_max_waiting=-1), dict(dest_min_free_fraction=1.0)):
        with pytest.raises(ValueError):
            MigrationLimits(**bad)

