"""The scheduler's prefix tracker, without a bus: its bookkeeping of the instances it hears."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from services.global_scheduler.prefix_tracker import PrefixTracker
from shared import subjects
from shared.messages import KvCacheEvents, KvCacheSnapshot, encode
from shared.prefix_index import SLACK_BLOCKS
from tests.unit.policy_helpers import make_load


def _events(iid: str, seq: int, stored: list[int]) -> SimpleNamespace:
    return SimpleNamespace(subject=subjects.kv_events(iid), data=encode(KvCacheEvents(iid, seq, 16, stored)))


def _snapshot(iid: str, seq: int, held: list[int]) -> SimpleNamespace:
    return SimpleNamespace(subject=subjects.kv_snapshot(iid), data=encode(KvCacheSnapshot(iid, seq, 16, held)))


def test_instances_that_left_leave_nothing_behind():
    live = {"here", "gone"}
    tracker = PrefixTracker(lambda: live, CollectorRegistry())
    for iid in live:  # (asked for a snapshot; the second's llumlet had no prefix cache)
        tracker._asked[iid] = tracker._no_cache[iid] = 0.0
    live = {"here"}
    tracker.tick()
    assert set(tracker._asked) == set(tracker._no_cache) == {"here"}
    live = set()
    tracker.tick()
    assert not tracker._asked and not tracker._no_cache


def test_an_instance_past_its_reported_cache_is_not_indexed_nor_asked_again_soon():
    loads = {"a": make_load("a", total=10)}
    registry = CollectorRegistry()
    tracker = PrefixTracker(lambda: loads, registry, load_of=loads.get)
    bound = 2 * 10 + SLACK_BLOCKS
    assert tracker.index.bound("a") == bound
    tracker._on_events(_events("a", 1, list(range(bound + 1))))
    assert tracker.events.labels("over_bound")._value.get() == 1 and tracker.events.labels("gap")._value.get() == 0
    assert tracker.index.num_blocks("a") == 0
    assert "a" in tracker._no_cache and not tracker.index.in_sync("a")  # (asked again after no_cache_retry_s)
    assert registry.get_sample_value("corral:scheduler_prefix_index_over_bound") == 1
    tracker._on_events(_events("a", 2, [1]))  # (waiting for a snapshot now: skipped)
    assert tracker.events.labels("skipped")._value.get() == 1
    tracker._on_snapshot(_snapshot("a", 1, list(range(bound + 1))))
    assert tracker.snapshots._value.get() == 0 and not tracker.index.in_sync("a")
    tracker._on_snapshot(_snapshot("a", 1, list(range(10))))  # within: applied
    assert tracker.index.in_sync("a") and "a" not in tracker._no_cache and tracker.index.num_blocks("a") == 10
    assert registry.get_sample_value("corral:scheduler_prefix_index_over_bound") == 0


def test_kv_messages_about_another_instance_are_refused_and_counted():
    from shared import bus_guard

    tracker = PrefixTracker(lambda: {"a", "b"}, CollectorRegistry())
    before = bus_guard.rejected_count("corral.kv.*.events", "wrong_subject")
    forged = SimpleNamespace(subject=subjects.kv_events("b"), data=encode(KvCacheEvents("a", 1, 16, [1])))
    tracker._on_events(forged)
    assert tracker.index.num_blocks("a") == 0 and not tracker.index.in_sync("a")
    assert bus_guard.rejected_count("corral.kv.*.events", "wrong_subject") == before + 1
    forged = SimpleNamespace(subject=subjects.kv_snapshot("b"), data=encode(KvCacheSnapshot("a", 0, 16, [1])))
    tracker._on_snapshot(forged)
    assert tracker.index.num_blocks("a") == 0 and tracker.snapshots._value.get() == 0
