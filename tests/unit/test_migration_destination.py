"""Destination side: leases, the handshake's decisions, frame admission and the lease watchdog
(no NATS, no sockets: the registry is driven directly)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import uvloop

from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.destination import IncomingMigrations
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_plan import TokenRun
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.kv_wire import AckStatus, FrameHeader
from services.llumlet.migration.protocol import ALREADY_COMMITTED, MigrationLimits, MigrationStatus, new_migration_id
from services.llumlet.migration.protocol import DestinationRefused
from shared.messages import MigrationAbort, PreAlloc, encode
from tests.unit.migration_helpers import (BLOCK_SIZE, FakeClock, decode_steps, export_kv, gen, import_kv, sim_config,
                                          verify_kv)

LIMITS = MigrationLimits(lease_s=2.0, max_in=2)


class Setup:
    def __init__(self, refusal: str | None = None, limits: MigrationLimits = LIMITS) -> None:
        self.engine = SimEngine(sim_config())
        self.ops = self.engine.migration_ops()
        self.copier = BlockCopier(self.ops.kv_regions())
        self.clock = FakeClock()
        self.changes = 0
        self.incoming = IncomingMigrations(self.ops, self.copier, limits, refusal=lambda: refusal,
                                           on_change=self._changed, clock=self.clock)
        self.incoming.kv_address = "127.0.0.1:9"

    def _changed(self) -> None:
        self.changes += 1

    async def prealloc(self, mid: str, stage: int, num_blocks: int, request_id: str = "r"):
        return await self.incoming.handle_prealloc(PreAlloc(mid, request_id, num_blocks, LIMITS.lease_s, stage))

    def frame(self, mid: str, offset: int, num_blocks: int) -> FrameHeader:
        return FrameHeader(mid, 0, offset, num_blocks, num_blocks * self.copier.block_bytes, 0)

    async def fill(self, mid: str, offset: int, num_blocks: int) -> AckStatus:
        payload = np.zeros(num_blocks * self.copier.block_bytes, dtype=np.uint8)
        return await self.incoming.write(self.frame(mid, offset, num_blocks), memoryview(payload))


@pytest.fixture
def setup():
    s = Setup()
    yield s
    s.copier.close()


async def test_prealloc_grows_one_lease_stage_by_stage(setup) -> None:
    mid = new_migration_id()
    first, second = await setup.prealloc(mid, 0, 5), await setup.prealloc(mid, 1, 2)
    assert first.ok and second.ok and first.kv_address == "127.0.0.1:9"
    assert len(first.block_ids) == 5 and len(second.block_ids) == 2
    assert setup.incoming.get(mid).block_ids == first.block_ids + second.block_ids
    assert setup.engine.num_reserved_blocks() == 7 and setup.engine.num_free_blocks() == 57


async def test_repeated_prealloc_of_a_stage_reserves_once(setup) -> None:
    mid = new_migration_id()
    first, again = await setup.prealloc(mid, 0, 5), await setup.prealloc(mid, 0, 5)
    assert again.ok and again.block_ids == first.block_ids
    assert setup.engine.num_reserved_blocks() == 5


async def test_a_migration_is_counted_once_when_its_first_prealloc_is_answered(setup) -> None:
    """Load reports carry the count (`num_migrations_asked_total`): the scheduler counts off by it
    the P/D hand-offs it accounted here that a report does not show yet. Once answered, a
    migration's blocks show (granted) or never will (refused), so refusals count too."""
    mid = new_migration_id()
    assert (await setup.prealloc(mid, 0, 5)).ok and setup.incoming.num_asked_total == 1
    assert (await setup.prealloc(mid, 0, 5)).ok and (await setup.prealloc(mid, 1, 2)).ok  # repeated; next stage
    assert setup.incoming.num_asked_total == 1
    assert not (await setup.prealloc(new_migration_id(), 0, 100, "big")).ok  # no room
    assert setup.incoming.num_asked_total == 2
    assert (await setup.prealloc(new_migration_id(), 0, 1, "b")).ok  # (max_in 2: the second one in)
    busy = await setup.prealloc(new_migration_id(), 0, 1, "c")
    assert not busy.ok and "busy" in busy.reason and setup.incoming.num_asked_total == 4


async def test_stage_out_of_order_is_refused(setup) -> None:
    mid = new_migration_id()
    assert not (await setup.prealloc(mid, 1, 5)).ok  # unknown migration past stage 0
    await setup.prealloc(mid, 0, 1)
    assert not (await setup.prealloc(mid, 2, 1)).ok
    assert setup.engine.num_reserved_blocks() == 1


async def test_no_room_refuses_and_ends_the_migration(setup) -> None:
    mid = new_migration_id()
    assert (await setup.prealloc(mid, 0, 10)).ok
    refused = await setup.prealloc(mid, 1, 100)
    assert not refused.ok and "no room" in refused.reason
    assert setup.incoming.get(mid).status is MigrationStatus.ABORTED_DST
    assert setup.engine.num_reserved_blocks() == 0 and setup.engine.num_free_blocks() == 64


async def test_concurrent_incoming_migrations_are_bounded(setup) -> None:
    assert (await setup.prealloc(new_migration_id(), 0, 1, "a")).ok
    assert (await setup.prealloc(new_migration_id(), 0, 1, "b")).ok
    busy = await setup.prealloc(new_migration_id(), 0, 1, "c")
    assert not busy.ok and "busy" in busy.reason


async def test_a_draining_instance_takes_no_migration() -> None:
    s = Setup(refusal="draining")
    reply = await s.prealloc(new_migration_id(), 0, 1)
    assert not reply.ok and reply.reason == "draining"
    s.copier.close()


async def test_abort_releases_and_is_idempotent(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 6)
    assert setup.incoming.handle_abort(MigrationAbort(mid, "request finished")).ok
    assert setup.incoming.handle_abort(MigrationAbort(mid)).ok
    assert setup.engine.num_free_blocks() == 64 and setup.engine.num_reserved_blocks() == 0
    assert setup.incoming.get(mid).status is MigrationStatus.ABORTED_SRC


async def test_abort_before_prealloc_refuses_a_late_prealloc(setup) -> None:
    mid = new_migration_id()
    assert setup.incoming.handle_abort(MigrationAbort(mid)).ok
    assert not (await setup.prealloc(mid, 0, 1)).ok
    assert setup.engine.num_reserved_blocks() == 0


async def committable(setup: Setup, request_id: str = "r"):
    """A request decoded on a separate source engine, its KV copied into a lease here."""
    src = SimEngine(sim_config())
    src.add_request(gen(request_id, 10, 40))
    await decode_steps(src, 6)
    await src.migration_ops().suspend(request_id)
    blocks = src.block_ids_of(request_id)
    mid = new_migration_id()
    lease = (await setup.prealloc(mid, 0, len(blocks), request_id)).block_ids
    import_kv(setup.engine, lease, export_kv(src, blocks))
    return mid, src.migration_ops().migration_commit(request_id, mid), len(blocks)


def mark_filled(setup, migration_id: str, num_blocks: int) -> None:
    """The frames' bookkeeping for `num_blocks` whole blocks (KV was imported directly)."""
    m = setup.incoming.get(migration_id)
    m.filled_tokens = num_blocks * m.block_size


async def test_commit_needs_every_block_written(setup) -> None:
    mid, commit, num_blocks = await committable(setup)
    ack, committed = setup.incoming.handle_commit(commit)
    assert not ack.ok and "incomplete" in ack.error and not committed
    assert setup.engine.num_reserved_blocks() == 0  # the migration is over, its lease released


async def test_commit_adds_the_request_once(setup) -> None:
    mid, commit, num_blocks = await committable(setup)
    mark_filled(setup, mid, num_blocks)
    ack, committed = setup.incoming.handle_commit(commit)
    assert ack.ok and committed
    assert verify_kv(setup.engine, "r") and setup.engine.get_request("r") is not None
    again, committed_again = setup.incoming.handle_commit(commit)
    assert again.ok and not committed_again  # acked, not added twice
    late_abort = setup.incoming.handle_abort(MigrationAbort(mid))
    assert not late_abort.ok and late_abort.error == ALREADY_COMMITTED
    assert setup.engine.get_request("r") is not None and setup.engine.num_reserved_blocks() == 0


async def test_commit_after_abort_is_refused(setup) -> None:
    mid, commit, num_blocks = await committable(setup)
    setup.incoming.handle_abort(MigrationAbort(mid))
    ack, committed = setup.incoming.handle_commit(commit)
    assert not ack.ok and not committed and setup.engine.get_request("r") is None


async def test_lease_expires_without_renewal(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 8)
    setup.clock.advance(1.5)
    assert setup.incoming.expire() == []
    await setup.prealloc(mid, 1, 1)  # renews
    setup.clock.advance(1.5)
    assert setup.incoming.expire() == []
    setup.clock.advance(1.0)
    assert [m.migration_id for m in setup.incoming.expire()] == [mid]
    assert setup.engine.num_free_blocks() == 64 and setup.engine.num_reserved_blocks() == 0
    setup.clock.advance(LIMITS.tombstone_s + 1)
    setup.incoming.expire()
    assert setup.incoming.get(mid) is None  # the tombstone is forgotten in the end


async def test_watchdog_task_frees_expired_leases() -> None:
    s = Setup(limits=MigrationLimits(lease_s=0.05, watchdog_interval_s=0.01))
    s.incoming._clock = asyncio.get_running_loop().time  # real time for the real loop
    await s.incoming.handle_prealloc(PreAlloc(new_migration_id(), "r", 4, 0.05, 0))
    watchdog = asyncio.create_task(s.incoming.run_watchdog())
    try:
        async with asyncio.timeout(2):
            while s.engine.num_reserved_blocks():
                await asyncio.sleep(0.01)
    finally:
        watchdog.cancel()
        s.copier.close()
    assert s.engine.num_free_blocks() == 64


async def test_frames_must_continue_the_lease_in_order(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 4)
    assert setup.incoming.admit(setup.frame(mid, 1, 2)) is AckStatus.BAD_RANGE  # skips block 0
    assert setup.incoming.admit(setup.frame(mid, 0, 5)) is AckStatus.BAD_RANGE  # past the lease
    bad_size = FrameHeader(mid, 0, 0, 2, 7, 0)
    assert setup.incoming.admit(bad_size) is AckStatus.BAD_SIZE
    assert setup.incoming.admit(setup.frame(new_migration_id(), 0, 1)) is AckStatus.UNKNOWN_MIGRATION
    assert await setup.fill(mid, 0, 3) is AckStatus.OK
    assert await setup.fill(mid, 3, 1) is AckStatus.OK
    assert setup.incoming.get(mid).filled == 4


async def test_token_frames_continue_the_lease_by_slot(setup) -> None:
    """Token frames (a block's slots) go on from the last position written, blocks after them
    from a block boundary only, and the KV counts as complete up to the computed tokens."""
    mid, bs, per_token = new_migration_id(), setup.copier.block_size, setup.copier.token_bytes
    assert bs and per_token
    await setup.prealloc(mid, 0, 3)

    def tokens(offset: int, count: int, nbytes: int | None = None) -> FrameHeader:
        return FrameHeader(mid, 0, offset, count, count * per_token if nbytes is None else nbytes, tokens=True)

    async def write(header: FrameHeader) -> AckStatus:
        return await setup.incoming.write(header, memoryview(np.zeros(header.payload_len, dtype=np.uint8)))

    assert setup.incoming.admit(tokens(1, 2)) is AckStatus.BAD_RANGE  # skips slot 0
    assert setup.incoming.admit(tokens(0, 3 * bs + 1)) is AckStatus.BAD_RANGE  # past the lease
    assert setup.incoming.admit(tokens(0, 2, 7)) is AckStatus.BAD_SIZE
    assert await write(tokens(0, bs + 1)) is AckStatus.OK  # block 0 and a slot of block 1
    m = setup.incoming.get(mid)
    assert (m.filled_tokens, m.filled) == (bs + 1, 1)
    assert setup.incoming.admit(setup.frame(mid, 1, 1)) is AckStatus.BAD_RANGE  # block 1 is begun
    assert await write(tokens(bs + 1, bs - 1)) is AckStatus.OK
    assert await setup.fill(mid, 2, 1) is AckStatus.OK  # on a block boundary: whole blocks again
    assert m.kv_complete(3 * bs - 1) and m.filled == 3
    # A layout without token slots takes no token frame.
    other = Setup()
    other.copier.block_size = other.copier.token_bytes = 0
    mid2 = new_migration_id()
    await other.prealloc(mid2, 0, 2)
    assert other.incoming.admit(FrameHeader(mid2, 0, 0, 1, 0, tokens=True)) is AckStatus.BAD_SIZE
    other.copier.close()


async def test_a_token_frame_that_fails_to_land_fails_and_unpins_the_lease(setup, monkeypatch) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 2)
    header = FrameHeader(mid, 0, 0, 3, setup.copier.token_frame_bytes(3), tokens=True)
    (view,) = setup.incoming.open_frame(header)
    assert view.nbytes == header.payload_len and setup.incoming.get(mid).writers == 1

    def broken(*args) -> None:
        raise RuntimeError("scatter broke")

    monkeypatch.setattr(setup.copier, "scatter_tokens", broken)
    assert setup.incoming.close_frame(header, ok=True) is AckStatus.FAILED
    m = setup.incoming.get(mid)
    assert m.writers == 0 and m.filled_tokens == 0 and m.token_buffer is None


async def test_the_commit_needs_the_computed_tokens_written_not_the_slots_past_them(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 2)
    m, bs = setup.incoming.get(mid), setup.copier.block_size
    m.filled_tokens = bs + 1
    assert m.kv_complete(bs + 1) and not m.kv_complete(bs + 2)


async def test_release_waits_for_a_scatter_in_flight(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 4)
    started, proceed = asyncio.Event(), asyncio.Event()
    real_scatter = setup.copier.scatter

    async def slow_scatter(block_ids, payload):
        started.set()
        await proceed.wait()
        await real_scatter(block_ids, payload)

    setup.copier.scatter = slow_scatter
    write = asyncio.create_task(setup.fill(mid, 0, 4))
    await started.wait()
    setup.incoming.handle_abort(MigrationAbort(mid))
    assert setup.engine.num_reserved_blocks() == 4  # still being written into: not yet free
    proceed.set()
    assert await write is AckStatus.UNKNOWN_MIGRATION
    assert setup.engine.num_reserved_blocks() == 0 and setup.engine.num_free_blocks() == 64


async def test_a_failed_frame_aborts_its_migration(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 4)
    setup.incoming.frame_failed(setup.frame(mid, 0, 4), AckStatus.BAD_CHECKSUM)
    assert setup.incoming.get(mid).status is MigrationStatus.ABORTED_DST
    assert setup.engine.num_reserved_blocks() == 0


async def test_client_abort_drops_an_incoming_migration_of_the_request(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 4, request_id="r7")
    setup.incoming.abort_request("other")
    assert setup.engine.num_reserved_blocks() == 4
    setup.incoming.abort_request("r7")
    assert setup.engine.num_reserved_blocks() == 0


async def test_stop_releases_every_lease(setup) -> None:
    await setup.prealloc(new_migration_id(), 0, 3, "a")
    await setup.prealloc(new_migration_id(), 0, 5, "b")
    setup.incoming.stop()
    assert setup.engine.num_reserved_blocks() == 0 and setup.incoming.num_active == 0


async def test_status_transitions_assert_the_starting_state(setup) -> None:
    mid = new_migration_id()
    await setup.prealloc(mid, 0, 1)
    m = setup.incoming.get(mid)
    m.abort(MigrationStatus.ABORTED_SRC, "test", 0.0)
    with pytest.raises(AssertionError):
        m.finish(0.0)
    with pytest.raises(AssertionError):
        m.abort(MigrationStatus.ABORTED_DST, "twice", 0.0)


async def test_a_corrupt_frame_on_the_wire_aborts_and_nothing_is_committed(setup, monkeypatch) -> None:
    """Through a real receiver: the checksum fails, the lease goes back, a commit is refused."""
    src = SimEngine(sim_config())
    src.add_request(gen("r", 30, 60))
    await decode_steps(src, 4)
    await src.migration_ops().suspend("r")
    blocks = src.block_ids_of("r")
    src_copier = BlockCopier(src.migration_ops().kv_regions())
    receiver = KVReceiver(setup.incoming, LIMITS, setup.copier.new_host_buffer)
    address = await receiver.start()
    senders = KVSenderPool(LIMITS)

    async def corrupt(view: memoryview) -> int:
        return 12345

    monkeypatch.setattr(senders, "checksum", corrupt)
    mid = new_migration_id()
    await setup.prealloc(mid, 0, len(blocks))
    try:
        with pytest.raises(DestinationRefused, match="BAD_CHECKSUM"):
            await senders.send_stage(address, mid, 0, 0, blocks, src_copier)
    finally:
        senders.close()
        await receiver.close()
        src_copier.close()
    assert setup.incoming.get(mid).status is MigrationStatus.ABORTED_DST
    assert setup.engine.num_reserved_blocks() == 0 and setup.engine.num_free_blocks() == 64
    ack, committed = setup.incoming.handle_commit(src.migration_ops().migration_commit("r", mid))
    assert not ack.ok and not committed and setup.engine.get_request("r") is None


# -- the COMMIT carried by the last KV frame ------------------------------------------------------


def committing(s: Setup) -> list:
    """Record every hand-over to the llumlet (`on_committed`)."""
    handed: list = []

    async def on_committed(commit) -> None:
        handed.append(commit.request.request_id)

    s.incoming._on_committed = on_committed
    return handed


async def test_commit_in_a_frame_commits_once_and_hands_the_request_over(setup) -> None:
    handed = committing(setup)
    mid, commit, num_blocks = await committable(setup)
    mark_filled(setup, mid, num_blocks)
    header = setup.frame(mid, num_blocks, 0)
    assert await setup.incoming.commit_frame(header, encode(commit), AckStatus.OK) == (AckStatus.COMMITTED, "")
    assert setup.engine.get_request("r") is not None and handed == ["r"]
    # A repeat (or the NATS COMMIT of the fallback) is acked from the record, nothing added twice.
    assert await setup.incoming.commit_frame(header, encode(commit), AckStatus.OK) == (AckStatus.COMMITTED, "")
    assert (await setup.incoming.commit(commit)).ok and handed == ["r"]


async def test_commit_in_a_failed_frame_is_refused(setup) -> None:
    handed = committing(setup)
    mid, commit, num_blocks = await committable(setup)
    header = setup.frame(mid, 0, num_blocks)
    setup.incoming.frame_failed(header, AckStatus.BAD_CHECKSUM)  # (what the receiver reports first)
    status, detail = await setup.incoming.commit_frame(header, encode(commit), AckStatus.BAD_CHECKSUM)
    assert status is AckStatus.BAD_CHECKSUM and "bad_checksum" in detail
    assert handed == [] and setup.engine.get_request("r") is None and setup.engine.num_reserved_blocks() == 0
    assert not (await setup.incoming.commit(commit)).ok  # a late NATS COMMIT gets the same answer


async def test_commit_in_a_frame_is_refused_when_the_kv_is_incomplete(setup) -> None:
    mid, commit, num_blocks = await committable(setup)
    status, detail = await setup.incoming.commit_frame(setup.frame(mid, 0, 0), encode(commit), AckStatus.OK)
    assert status is AckStatus.COMMIT_REFUSED and "KV incomplete" in detail
    assert setup.incoming.get(mid).status is MigrationStatus.ABORTED_DST and setup.engine.num_reserved_blocks() == 0


async def test_garbage_or_foreign_commit_in_a_frame_ends_the_migration(setup) -> None:
    mid, commit, num_blocks = await committable(setup)
    mark_filled(setup, mid, num_blocks)
    status, detail = await setup.incoming.commit_frame(setup.frame(mid, 0, 0), b"\x93garbage", AckStatus.OK)
    assert status is AckStatus.COMMIT_REFUSED and detail
    assert setup.incoming.get(mid).status is MigrationStatus.ABORTED_DST and setup.engine.num_reserved_blocks() == 0
    other, _, _ = await committable(setup, "q")
    mark_filled(setup, other, len(setup.incoming.get(other).block_ids))
    status, detail = await setup.incoming.commit_frame(setup.frame(other, 0, 0), encode(commit), AckStatus.OK)
    assert status is AckStatus.COMMIT_REFUSED and "another migration" in detail
    assert setup.engine.get_request("q") is None and setup.engine.num_reserved_blocks() == 0


@pytest.mark.parametrize("kv_bytes_per_token", [64, 4096], ids=["blocks-staged", "blocks-lent"])
def test_token_frames_around_whole_blocks_land_in_order_through_a_receiver(kv_bytes_per_token) -> None:
    """Over a real connection: a token frame leaves a block begun; the next stage sends the rest
    of it by token, whole blocks, and the slots of the last by token. Token frames are lent (a
    buffer of the lease, scattered as the frame ends); whole blocks are lent where their pieces
    are large (16 KiB) and staged where small (scattered by the connection's worker later). The
    sink admits a lent frame at its header and a staged one at its scatter, so the receiver
    lends nothing while a staged frame waits: every frame is admitted in order, and the
    destination holds every computed token's bytes. On uvloop, as the llumlets run: it reads
    the next header before the worker scatters a staged frame."""
    uvloop.run(token_frames_around_whole_blocks(kv_bytes_per_token))


async def token_frames_around_whole_blocks(kv_bytes_per_token: int) -> None:
    config = sim_config(kv_bytes_per_token=kv_bytes_per_token)
    src, dst = SimEngine(config), SimEngine(config)
    src.add_request(gen("r", 30, 60))
    await decode_steps(src, 4)
    await src.migration_ops().suspend("r")
    blocks, computed = src.block_ids_of("r"), src.get_request("r").num_computed_tokens
    src_copier = BlockCopier(src.migration_ops().kv_regions())
    dst_copier = BlockCopier(dst.migration_ops().kv_regions())
    assert (dst_copier.block_views([1, 2]) is not None) == (kv_bytes_per_token == 4096)  # (lent whole blocks)
    incoming = IncomingMigrations(dst.migration_ops(), dst_copier, LIMITS)
    receiver = KVReceiver(incoming, LIMITS, dst_copier.new_host_buffer)
    address = await receiver.start()
    senders = KVSenderPool(LIMITS)
    mid, bs = new_migration_id(), BLOCK_SIZE
    try:
        assert (await incoming.handle_prealloc(PreAlloc(mid, "r", len(blocks), LIMITS.lease_s, 0))).ok
        await senders.send_stage(address, mid, 0, 0, [], src_copier, tokens=TokenRun(blocks, 0, 2))
        whole = computed // bs
        await senders.send_stage(address, mid, 1, 1, blocks[1:whole], src_copier, head=TokenRun(blocks, 2, bs),
                                 tokens=TokenRun(blocks, whole * bs, computed))
        m = incoming.get(mid)
        assert m.status is MigrationStatus.RUNNING and m.filled_tokens == computed and m.kv_complete(computed)
        assert dst.kv_pool.verify(src.tokens.key("r"), m.block_ids, computed)
    finally:
        senders.close()
        await receiver.close()
        src_copier.close()
        dst_copier.close()
