"""The llumlet's KV events: the journal's net changes, the sim engine's prefix cache feeding it,
and the publisher and the scheduler's tracker over a real nats-server (a lost message and a
restarted scheduler resynchronise from a snapshot)."""

from __future__ import annotations

import asyncio

import nats
from prometheus_client import CollectorRegistry

from services.global_scheduler.prefix_tracker import PrefixTracker
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.kv_events import KvEventPublisher, _split
from services.llumlet.kv_journal import KvDelta, KvEventJournal, journal_of
from shared.messages import GenerateRequest, SamplingParams
from shared.prefix_hash import block_hashes
from tests.unit.migration_helpers import sim_config


def test_the_journal_sends_net_changes_and_mirrors_what_is_held():
    journal = KvEventJournal()
    journal.stored([1, 2, 3])
    journal.removed([2])
    journal.removed([3])
    journal.stored([3])  # evicted and stored again between two messages: stored
    delta = journal.take()
    assert sorted(delta.stored) == [1, 3] and delta.removed == [2] and not delta.cleared
    assert journal.take().is_empty
    journal.stored([4])
    journal.cleared()
    journal.stored([5])
    delta, held = journal.take_with_snapshot()
    assert delta == KvDelta(True, [5], []) and held == [5]


def test_a_large_change_is_cut_into_messages_removals_first():
    parts = list(_split(KvDelta(True, [10, 11, 12], [1, 2]), limit=2))
    assert [(p.cleared, p.removed, p.stored) for p in parts] == [(True, [1, 2], []), (False, [], [10, 11]),
                                                                  (False, [], [12])]


async def test_the_sim_engines_cache_writes_its_stores_and_evictions_to_the_journal():
    engine = SimEngine(sim_config(time_scale=1e-5, num_blocks=8, block_size=4, max_model_len=64,
                                  enable_prefix_caching=True))
    journal = journal_of(engine)
    assert journal is not None and journal_of(engine) is journal

    async def run(rid: str, prompt: list[int]) -> None:
        engine.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), "out"))
        while engine.has_work():
            await engine.step()

    first = list(range(1, 13))  # 3 full blocks
    await run("a", first)
    assert sorted(journal.take().stored) == sorted(block_hashes(first, 4))
    second = list(range(100, 128))  # 7 blocks: the 8-block pool must evict the first prompt's
    await run("b", second)
    delta = journal.take()
    assert delta.removed and set(delta.removed) <= set(block_hashes(first, 4))
    assert set(delta.stored) == set(block_hashes(second, 4))
    assert sorted(journal.take_with_snapshot()[1]) == sorted(engine.scheduler.prefix_cache.held_hashes())


def test_an_engine_without_a_prefix_cache_has_no_journal():
    engine = SimEngine(sim_config(time_scale=1e-5, num_blocks=8, block_size=4, max_model_len=64))
    assert journal_of(engine) is None


async def _until(predicate, timeout_s: float = 15.0) -> None:  # (a loaded machine is slow, not wrong)
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_events_keep_the_index_and_a_gap_or_a_restart_resynchronises(nats_url):
    llumlet_nc, scheduler_nc = await nats.connect(nats_url), await nats.connect(nats_url)
    journal = KvEventJournal()
    publisher = KvEventPublisher("kv-a", 16, journal, lambda: llumlet_nc, interval_s=0.01, snapshot_interval_s=3600)
    await publisher.subscribe(llumlet_nc)
    tracker = PrefixTracker(lambda: ["kv-a"], CollectorRegistry(), resync_retry_s=0.05)
    await tracker.start(scheduler_nc)
    sender = asyncio.create_task(publisher.run())  # (first: the changes so far, then a snapshot)
    try:
        journal.stored([1, 2, 3])
        await _until(lambda: tracker.index.matches([1, 2, 3]) == {"kv-a": 3})
        # A lost message: taken and never sent, its number spent. The next one shows the gap.
        journal.removed([3])
        journal.take()
        publisher.seq += 1
        journal.stored([7])
        # The gap is not applied; the tracker asks for a snapshot at once, and the snapshot heals it.
        await _until(lambda: tracker.events.labels("gap")._value.get() == 1)
        await _until(lambda: tracker.index.in_sync("kv-a") and tracker.index.matches([7]) == {"kv-a": 1})
        assert tracker.index.matches([1, 2, 3]) == {"kv-a": 2}
        assert tracker.snapshot_requests._value.get() == 1
        # A scheduler started now has heard nothing: it asks every live instance.
        fresh = PrefixTracker(lambda: ["kv-a"], CollectorRegistry())
        await fresh.start(scheduler_nc)
        fresh.tick()
        await _until(lambda: fresh.index.in_sync("kv-a"))
        assert fresh.index.matches([1, 2]) == {"kv-a": 2}
        # An instance that left is forgotten.
        fresh._live_instances = lambda: []
        fresh.tick()
        assert fresh.index.matches([1, 2]) == {} and fresh.index.size == 0
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        await tracker.stop()
        await llumlet_nc.close()
        await scheduler_nc.close()


async def test_an_instance_without_a_cache_is_not_asked_every_tick(nats_url):
    nc = await nats.connect(nats_url)
    tracker = PrefixTracker(lambda: ["no-cache"], CollectorRegistry(), resync_retry_s=0.0)
    await tracker.start(nc)
    try:
        tracker.tick()
        await _until(lambda: not tracker._requests)
        tracker.tick()
        await asyncio.sleep(0.05)
        assert tracker.snapshot_requests._value.get() == 1
    finally:
        await tracker.stop()
        await nc.close()


class _FakeBus:
    """A NATS client stand-in: connected or not, recording what is published."""

    def __init__(self) -> None:
        self.is_connected = True
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((subject, data))


async def _sent_then_cut_off(instance_id: str) -> tuple[_FakeBus, KvEventJournal, KvEventPublisher]:
    """A publisher that sent hashes 1 and 2 (seq 1), then lost NATS."""
    bus = _FakeBus()
    journal = KvEventJournal()
    publisher = KvEventPublisher(instance_id, 16, journal, lambda: bus)
    journal.stored([1, 2])
    await publisher.publish_changes()
    bus.is_connected = False
    return bus, journal, publisher


async def test_changes_made_while_nats_is_away_go_out_later_under_the_next_seq():
    from shared.messages import KvCacheEvents, KvCacheSnapshot, decode

    bus, journal, publisher = await _sent_then_cut_off("kv-b")
    journal.stored([3])
    journal.removed([1])
    await publisher.publish_changes()
    await publisher.publish_snapshot()  # nothing goes out while away, and nothing is lost
    journal.stored([4])
    journal.removed([3])
    bus.is_connected = True
    await publisher.publish_snapshot()
    kinds = [subject.rsplit(".", 1)[1] for subject, _ in bus.sent]
    assert kinds == ["events", "events", "snapshot"]
    first, held_back = (decode(data, KvCacheEvents) for _, data in bus.sent[:2])
    assert (first.seq, sorted(first.stored)) == (1, [1, 2])
    assert (held_back.seq, sorted(held_back.stored), sorted(held_back.removed)) == (2, [4], [1, 3])
    snapshot = decode(bus.sent[2][1], KvCacheSnapshot)
    assert (snapshot.seq, sorted(snapshot.block_hashes)) == (2, [2, 4])


async def test_a_cache_past_one_message_is_snapshotted_in_parts_the_index_whole_after_the_last(monkeypatch):
    from services.llumlet import kv_events
    from shared.messages import KvCacheEvents, KvCacheSnapshot, decode
    from shared.prefix_index import GlobalPrefixIndex

    bus = _FakeBus()
    journal = KvEventJournal()
    publisher = KvEventPublisher("kv-c", 16, journal, lambda: bus)
    journal.stored(list(range(1, 8)))
    await publisher.publish_changes()
    monkeypatch.setattr(kv_events, "HASHES_PER_MESSAGE", 3)  # (a large GPU's cache: ~100k blocks and more)
    await publisher.publish_snapshot()
    kinds = [subject.rsplit(".", 1)[1] for subject, _ in bus.sent]
    assert kinds == ["events", "snapshot", "events", "events"]
    snapshot = decode(bus.sent[1][1], KvCacheSnapshot)
    rest = [decode(data, KvCacheEvents) for _, data in bus.sent[2:]]
    assert snapshot.seq == 1 and [e.seq for e in rest] == [2, 3] and publisher.seq == 3
    assert all(len(m.block_hashes if m is snapshot else m.stored) <= 3 for m in (snapshot, *rest))
    # A scheduler that starts over from this snapshot has every block once the parts are in.
    index = GlobalPrefixIndex()
    index.restore(snapshot)
    assert all(index.apply(events) for events in rest)
    assert index.in_sync("kv-c") and index.matches(list(range(1, 8))) == {"kv-c": 7}


async def test_while_nats_is_away_the_journal_merges_in_place_and_a_long_churn_becomes_one_resync(monkeypatch):
    # was: every 50 ms tick rebuilt the whole held-back delta (100 ms of the loop past 600k
    # hashes), and every hash evicted during the outage stayed in it
    from services.llumlet import kv_journal
    from shared.messages import KvCacheEvents, decode

    monkeypatch.setattr(kv_journal, "MAX_CHANGES_OVER_HELD", 8)
    bus, journal, publisher = await _sent_then_cut_off("kv-d")
    journal.stored([3])
    await publisher.publish_changes()
    assert journal._changes == {3: True}  # not taken: nothing rebuilt per tick
    for block_hash in range(100, 120):  # churn: stored and evicted while away
        journal.stored([block_hash])
        journal.removed([block_hash])
    assert journal._cleared and journal._changes == {1: True, 2: True, 3: True}  # collapsed: a resync
    bus.is_connected = True
    await publisher.publish_changes()
    resync = decode(bus.sent[-1][1], KvCacheEvents)
    assert (resync.seq, resync.cleared, sorted(resync.stored), resync.removed) == (2, True, [1, 2, 3], [])


def test_a_delta_put_back_goes_under_the_changes_made_since():
    journal = KvEventJournal()
    journal.stored([1, 2])
    taken = journal.take()
    journal.removed([2])
    journal.stored([3])
    journal.put_back(taken)  # (its send failed)
    delta = journal.take()
    assert sorted(delta.stored) == [1, 3] and delta.removed == [2] and not delta.cleared
    journal.stored([4])
    journal.cleared()
    journal.put_back(KvDelta(False, [5], []))  # older than the clear: moot
    assert journal.take() == KvDelta(True, [], [])


async def test_snapshot_requests_queued_together_share_one_snapshot():
    # was: each ask built and sent its own: N schedulers after a blip, N full snapshots to each
    from types import SimpleNamespace

    from shared.messages import Ack, decode

    bus = _FakeBus()
    journal = KvEventJournal()
    journal.stored(list(range(1, 6)))
    publisher = KvEventPublisher("kv-e", 16, journal, lambda: bus)
    answers: list[bytes] = []

    async def respond(data: bytes) -> None:
        answers.append(data)

    for _ in range(8):  # (nats-py hands them over one by one)
        await publisher._on_snapshot_request(SimpleNamespace(reply="inbox", respond=respond))
    await _until(lambda: len(answers) == 8)
    kinds = [subject.rsplit(".", 1)[1] for subject, _ in bus.sent]
    assert kinds == ["events", "snapshot"] and all(decode(a, Ack).ok for a in answers)
    await publisher._on_snapshot_request(SimpleNamespace(reply="inbox", respond=respond))  # a later ask: a later one
    await _until(lambda: len(answers) == 9)
    assert [subject.rsplit(".", 1)[1] for subject, _ in bus.sent] == ["events", "snapshot", "snapshot"]
