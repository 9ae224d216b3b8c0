"""Source coordinator: the multi-stage protocol against a real destination registry and a real
loopback KV receiver, with the handshake called directly (no NATS) so that faults can be injected
at any step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from shared.engine_model.views import EngineError
from services.llumlet.engines.sim.engine import SimEngine
from shared.engine_model.request import RequestStatus
from services.llumlet.migration import kv_sender
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.destination import IncomingMigrations
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.ops import LivePhase
from services.llumlet.migration.protocol import (
    DestinationGone,
    DestinationSlow,
    MigrationLimits,
    MigrationStatus,
    PreAllocGrant,
)
from services.llumlet.migration.outgoing import OutgoingMigration
from services.llumlet.migration.source import MigrationCoordinator
from shared.messages import Ack, MigrateOrder, MigrationAbort, MigrationCommit, PreAlloc
from tests.unit.migration_helpers import FakeClock, expected_tokens, gen, sim_config, verify_kv

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

    def __init__(self, limits: MigrationLimits, **engine_overrides) -> None:
        self.limits = limits
        config = sim_config(time_scale=TIME_SCALE, num_blocks=256, max_model_len=2048, **engine_overrides)
        self.src, self.dst = SimEngine(config), SimEngine(config)
        self.src_ops, self.dst_ops = self.src.migration_ops(), self.dst.migration_ops()
        self.src_copier, self.dst_copier = BlockCopier(self.src_ops.kv_regions()), BlockCopier(self.dst_ops.kv_regions())
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

    async def make(limits: MigrationLimits = MigrationLimits(), **engine_overrides) -> Harness:
        harness = Harness(limits, **engine_overrides)
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


# -- the normal path ---------------------------------------------------------------------------


async def test_a_decoding_request_moves_and_continues_the_same_stream(make_harness) -> None:
    h = await make_harness()
    await h.decoding("r", prompt=50, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert verify_kv(h.dst, "r") and h.src.get_request("r") is None
    assert h.hooks.migrated_out_ids == ["r"]
    assert m.stages[-1].final and not any(s.final for s in m.stages[:-1])
    assert sum(s.num_blocks for s in m.stages) == m.blocks_sent == m.lease_blocks
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    assert any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


async def test_stages_shrink_while_the_request_keeps_decoding(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0, stage_limit=10))
    await h.decoding("r", prompt=200, max_tokens=600)
    h.link.before["prealloc"] = steps_later(h.src, "r", 4)  # one block of new tokens per stage
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert len(m.stages) >= 3
    sizes = [s.num_blocks for s in m.stages]
    assert sizes[0] >= 50 and all(n <= 3 for n in sizes[1:-1]), sizes
    # The forced last stage also carries what was decoded while its PRE-ALLOC went out (before
    # the suspend), plus the partial block: one stage's worth more at most.
    assert m.stages[-1].final and sizes[-1] <= 6, sizes
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 600)


async def test_the_stage_limit_forces_the_last_stage(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0, stage_limit=3))
    await h.decoding("r", prompt=100, max_tokens=600)
    h.link.before["prealloc"] = steps_later(h.src, "r", 8)  # always new blocks: never converges
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert [s.final for s in m.stages] == [False, False, True]
    assert h.link.calls.count("prealloc") == 4  # the last stage's before the suspend, and a top-up
    assert m.stages[-1].prealloc_s > 0
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 600)


async def test_a_blocking_copy_reserves_before_the_suspend(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=1))
    await h.decoding("r", prompt=100, max_tokens=200)
    phases = []

    async def record_phase(msg: PreAlloc) -> None:
        phases.append(h.src_ops.migration_snapshot("r").phase)

    h.link.before["prealloc"] = record_phase
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert phases[0] is LivePhase.RUNNING  # the reservation is off the downtime
    assert m.stages[-1].prealloc_s == 0.0 or phases[1:] == [LivePhase.SUSPENDED]  # (a top-up, if it grew)
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()


async def test_stage_limit_one_is_a_blocking_copy(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=1))
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED
    assert len(m.stages) == 1 and m.stages[0].final and m.stages[0].num_blocks == m.blocks_sent
    assert m.downtime_s is not None and m.downtime_s > 0
    await h.wait_finished("r")
    h.assert_blocks_back()


async def test_an_engine_without_kv_bytes_still_runs_the_whole_protocol(make_harness) -> None:
    h = await make_harness(kv_bytes_per_token=0)
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED and sum(s.num_bytes for s in m.stages) == 0
    assert m.blocks_sent == m.lease_blocks > 0
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()


# -- faults: each ends with the request on exactly one instance and every block back --------------


async def test_request_finishing_during_a_stage_aborts_the_migration(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=30, min_output=5)
    h.link.before["prealloc"] = steps_later(h.src, "r", 100)  # outlives the request
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_SRC and "finished" in m.reason
    assert "abort" in h.link.calls
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 30)
    assert not any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


async def test_destination_without_room_leaves_the_request_here(make_harness) -> None:
    h = await make_harness()
    filler = await h.dst_ops.reserve_blocks("someone-else", 250)  # 6 blocks left on the destination
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "no room" in m.reason
    h.dst_ops.release_reservation("someone-else")
    assert filler and h.src.get_request("r").status is RequestStatus.RUNNING  # still here
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()


async def test_destination_gone_in_the_last_stage_resumes_the_request(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=2, last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=300)

    last_stage_preallocs = 0

    async def gone_at_last_stage(msg: PreAlloc) -> None:
        nonlocal last_stage_preallocs
        if msg.stage == 1:
            last_stage_preallocs += 1
            if last_stage_preallocs == 1:  # before the suspend: let the request start new blocks
                await steps_later(h.src, "r", 8)(msg)
                return
            assert h.src_ops.migration_snapshot("r").phase is LivePhase.SUSPENDED  # its top-up
            raise DestinationGone("killed")

    h.link.before["prealloc"] = gone_at_last_stage
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and h.hooks.resumes == 1
    assert "abort" not in h.link.calls  # nobody to tell
    assert h.src_ops.migration_snapshot("r").phase is LivePhase.RUNNING
    h.incoming.stop()  # (what the lease watchdog does when nobody comes back)
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_slow_destination_gets_an_abort_and_the_request_resumes(make_harness, monkeypatch) -> None:
    """The commit's frame is cut (the destination aborts it) and the NATS COMMITs that follow go
    unanswered: the ABORT decides, and the request goes on here."""
    h = await make_harness(MigrationLimits(stage_limit=2, last_stage_blocks=0))
    cut_the_commit_frame(monkeypatch)
    await h.decoding("r", prompt=100, max_tokens=300)

    async def slow_commit(msg) -> None:
        raise DestinationSlow("no answer")

    h.link.before["commit"] = slow_commit  # (the ABORT that resolves the doubt gets through)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and h.hooks.resumes == 1
    assert m.commit_via == "frame+nats" and h.link.calls.count("commit") == h.limits.commit_attempts
    assert h.link.calls[-1] == "abort" and h.hooks.migrated_out_ids == []
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_unanswered_commit_that_did_land_counts_as_committed(make_harness) -> None:
    """The frame committed but its ack was lost, and so was the NATS COMMIT's reply: the ABORT
    is answered "already committed", so the request is released here, not resumed."""
    h = await make_harness(MigrationLimits(commit_attempts=1))
    added = count_adds(h)
    lose_the_commit_ack(h)
    await h.decoding("r", prompt=60, max_tokens=300)
    real_commit = h.link.commit

    async def commit_lost_reply(dst, msg):
        await real_commit(dst, msg)  # answered from the record, the reply is lost
        raise DestinationSlow("reply lost")

    h.link.commit = commit_lost_reply
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED and h.src.get_request("r") is None
    assert m.commit_via == "frame+nats" and h.link.calls[-1] == "abort"
    assert added == ["r"] and h.hooks.resumes == 0 and h.hooks.migrated_out_ids == ["r"]
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_commit_outcome_unknown_fails_the_request(make_harness) -> None:
    """The frame's ack is lost and the destination answers nothing over NATS either: nobody
    knows where the request runs, so it ends with an error (never resumed on a guess)."""
    h = await make_harness(MigrationLimits(commit_attempts=1, in_doubt_deadline_s=0.05, abort_timeout_s=0.01))
    lose_the_commit_ack(h)
    await h.decoding("r", prompt=60, max_tokens=300)

    async def silent(msg) -> None:
        raise DestinationSlow("partitioned")

    h.link.before["commit"] = silent
    h.link.before["abort"] = silent
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "unknown" in m.reason
    assert m.commit_via == "frame+nats" and h.hooks.resumes == 0
    assert h.hooks.failed == [("r", "migration outcome unknown")]


async def test_preemption_during_a_stage_aborts_the_migration(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=300)

    async def preempt(msg: PreAlloc) -> None:
        if msg.stage == 1:
            request = h.src.get_request("r")
            h.src.scheduler.running.remove(request)
            h.src.scheduler.block_manager.free("r")
            request.preempt(0.0)
            h.src.scheduler._push_waiting(request, front=True)

    h.link.before["prealloc"] = _chain(steps_later(h.src, "r", 4), preempt)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_SRC and "preempted" in m.reason
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


def _chain(*hooks):
    async def run(msg) -> None:
        for hook in hooks:
            await hook(msg)

    return run


async def test_client_abort_during_a_stage_ends_both_sides(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0))
    await h.decoding("r", prompt=100, max_tokens=300)

    async def client_aborts(msg: PreAlloc) -> None:
        if msg.stage == 1:
            h.src.abort_request("r")

    h.link.before["prealloc"] = _chain(steps_later(h.src, "r", 4), client_aborts)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_SRC
    h.assert_blocks_back()


async def test_stopping_the_source_resumes_and_tells_the_destination(make_harness) -> None:
    h = await make_harness(MigrationLimits(last_stage_blocks=0, stage_limit=3))
    await h.decoding("r", prompt=100, max_tokens=400)
    hang = asyncio.Event()

    async def hang_in_last_stage(msg: PreAlloc) -> None:
        if msg.stage == 2:
            hang.set()
            await asyncio.sleep(60)

    h.link.before["prealloc"] = _chain(steps_later(h.src, "r", 4), hang_in_last_stage)
    task = asyncio.create_task(h.coordinator.migrate("r", "dst"))
    await asyncio.wait_for(hang.wait(), 5)
    await h.coordinator.stop()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    m = h.coordinator.history[-1]
    assert m.status is MigrationStatus.ABORTED_SRC and "stopping" in m.reason
    assert h.src_ops.migration_snapshot("r").phase is LivePhase.RUNNING
    assert h.dst.num_reserved_blocks() == 0  # the ABORT reached it


# -- the COMMIT in the last KV frame (the default) and its NATS fallback --------------------------


def count_adds(h: Harness) -> list[str]:
    """Every add_migrated on the destination (a request must be added exactly once)."""
    added: list[str] = []
    real_add = h.dst_ops.add_migrated

    def add(commit, lease_id):
        added.append(commit.request.request_id)
        return real_add(commit, lease_id)

    h.dst_ops.add_migrated = add
    return added


async def test_the_commit_rides_in_the_last_frame_and_its_ack_ends_the_downtime(make_harness) -> None:
    h = await make_harness()
    added = count_adds(h)
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert m.commit_via == "frame" and "commit" not in h.link.calls  # no NATS COMMIT at all
    assert h.link.calls[-1] == "prealloc"  # the last stage's, before the suspend
    assert m.stages[-1].final and m.stages[-1].prealloc_s == 0.0
    assert m.downtime_s == pytest.approx(m.committed_at - m.suspended_at) and m.commit_s > 0
    assert added == ["r"] and h.hooks.migrated_out_ids == ["r"]
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_a_blocking_copy_carries_the_commit_too(make_harness) -> None:
    h = await make_harness(MigrationLimits(stage_limit=1, frame_bytes=1024))  # a stage of many frames
    await h.decoding("r", prompt=100, max_tokens=200)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED and m.commit_via == "frame"
    assert len(m.stages) == 1 and m.stages[0].num_blocks == m.blocks_sent
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 200)
    h.assert_blocks_back()


async def test_a_commit_refused_in_the_frame_resumes_the_request_here(make_harness) -> None:
    h = await make_harness()

    def refuse(commit, lease_id):
        raise EngineError("does not fit")

    h.dst_ops.add_migrated = refuse
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "commit refused" in m.reason and "does not fit" in m.reason
    assert h.hooks.resumes == 1 and h.hooks.migrated_out_ids == [] and "commit" not in h.link.calls
    assert h.src_ops.migration_snapshot("r").phase is LivePhase.RUNNING
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    assert not any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


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


async def test_ack_lost_after_the_frame_committed_is_resolved_once_over_nats(make_harness) -> None:
    h = await make_harness()
    added = count_adds(h)
    lose_the_commit_ack(h)
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.FINISHED, m.reason
    assert m.commit_via == "frame+nats" and h.link.calls.count("commit") == 1  # answered from the record
    assert added == ["r"] and h.hooks.migrated_out_ids == ["r"] and h.hooks.resumes == 0
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    h.assert_blocks_back()


async def test_connection_lost_before_the_commit_landed_resumes_the_request_once(make_harness, monkeypatch) -> None:
    h = await make_harness()
    added = count_adds(h)
    cut_the_commit_frame(monkeypatch)  # the header only: the destination aborts the migration (TRUNCATED)
    await h.decoding("r", prompt=60, max_tokens=300)
    m = await h.coordinator.migrate("r", "dst")
    assert m.status is MigrationStatus.ABORTED_DST and "commit refused" in m.reason, m.reason
    assert m.commit_via == "frame+nats" and h.link.calls.count("commit") == 1
    assert added == [] and h.hooks.resumes == 1 and h.hooks.migrated_out_ids == []
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)
    assert not any(o.request_id == "r" for o in h.outputs["dst"])
    h.assert_blocks_back()


async def test_stopping_while_the_commit_is_in_flight_asks_before_resuming(make_harness) -> None:
    """Cancelled after the frame went out: the ABORT decides; the destination had committed,
    so the request is released here, not resumed (it must not run twice)."""
    h = await make_harness()
    added = count_adds(h)
    real_commit_frame = h.incoming.commit_frame
    committed = asyncio.Event()

    async def commit_then_hang(header, raw, frame_status):
        answer = await real_commit_frame(header, raw, frame_status)
        committed.set()
        await asyncio.sleep(60)  # the ack is late
        return answer

    h.incoming.commit_frame = commit_then_hang
    await h.decoding("r", prompt=60, max_tokens=300)
    task = asyncio.create_task(h.coordinator.migrate("r", "dst"))
    await asyncio.wait_for(committed.wait(), 5)
    await h.coordinator.stop()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    m = h.coordinator.history[-1]
    assert m.status is MigrationStatus.FINISHED and h.link.calls[-1] == "abort"
    assert added == ["r"] and h.hooks.resumes == 0 and h.src.get_request("r") is None
    h.receiver.drop_connections()
    await h.wait_finished("r")
    assert h.stream("r") == expected_tokens(h.src, "r", 300)


# -- pairs and the migrate-out loop ----------------------------------------------------------------


def test_orders_are_idempotent_and_lapse_without_confirmation() -> None:
    clock = FakeClock()
    c = MigrationCoordinator("me", None, None, None, None, MigrationLimits(pair_ttl_s=1.0), Hooks(), clock=clock)
    c.on_order(MigrateOrder("p1", "dst-a"))
    clock.advance(0.8)
    c.on_order(MigrateOrder("p1", "dst-a"))  # re-confirmed
    clock.advance(0.8)
    assert c.current_destination() == "dst-a"
    clock.advance(0.3)
    assert c.current_destination() is None  # lapsed: the scheduler stopped confirming
    c.on_order(MigrateOrder("p2", "dst-b"))
    c.on_order(MigrateOrder("p1", "dst-a", cancel=True))  # an old pair's cancel changes nothing
    assert c.current_destination() == "dst-b"
    c.on_order(MigrateOrder("p2", "dst-b", cancel=True))
    assert c.current_destination() is None
    c.on_order(MigrateOrder("p3", "me"))
    assert c.current_destination() is None


async def test_the_loop_migrates_lowest_priority_then_shortest_until_cancelled(make_harness) -> None:
    h = await make_harness(MigrationLimits(min_residence_s=0))  # (the guard has its own tests)
    h.src.add_request(gen("long-normal", 300, 2000))
    h.src.add_request(gen("short-normal", 80, 2000))
    h.src.add_request(gen("short-high", 40, 2000, priority=-1))
    async with asyncio.timeout(5):
        while len(h.src_ops.migration_candidates()) < 3:
            await asyncio.sleep(0.001)
    loop = asyncio.create_task(h.coordinator.run())
    try:
        h.coordinator.on_order(MigrateOrder("p", "dst"))
        async with asyncio.timeout(10):
            while len(h.coordinator.history) < 2:
                await asyncio.sleep(0.002)
        h.coordinator.on_order(MigrateOrder("p", "dst", cancel=True))
        await asyncio.sleep(0.05)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    moved = [m.request_id for m in h.coordinator.history]
    assert moved[:2] == ["short-normal", "long-normal"]
    assert "short-high" not in moved[:2]
    assert all(m.status is MigrationStatus.FINISHED for m in h.coordinator.history)
    assert h.coordinator.num_active == 0


def test_migration_transitions_assert_the_starting_state() -> None:
    m = OutgoingMigration("m", "r", "dst", 0)
    m.finish(1.0)
    with pytest.raises(AssertionError):
        m.abort(MigrationStatus.ABORTED_DST, "late", 2.0)
    with pytest.raises(AssertionError):
        m.finish(2.0)
    with pytest.raises(AssertionError):
        OutgoingMigration("m", "r", "dst", 0).abort(MigrationStatus.FINISHED, "not an abort", 0.0)
