"""The global prefix index fed by KV-cache events and snapshots."""

from __future__ import annotations

import random

from shared.messages import KvCacheEvents, KvCacheSnapshot, decode, encode
from shared.prefix_index import SLACK_BLOCKS, UNKNOWN_CAPACITY_BLOCKS, GlobalPrefixIndex
from shared.prefix_hash import block_hashes


def events(iid: str, seq: int, stored=(), removed=(), cleared=False) -> KvCacheEvents:
    return KvCacheEvents(iid, seq, 16, list(stored), list(removed), cleared)


CHAIN = block_hashes(list(range(16 * 6)), 16)


def test_a_prefix_matches_up_to_its_first_missing_block():
    index = GlobalPrefixIndex()
    assert index.apply(events("a", 1, stored=CHAIN[:4]))
    assert index.apply(events("b", 1, stored=CHAIN[:2] + CHAIN[3:5]))  # block 2 evicted there
    assert index.matched_blocks("a", CHAIN) == 4 and index.matched_blocks("b", CHAIN) == 2
    assert index.matched_blocks("c", CHAIN) == 0
    assert index.matches(CHAIN) == {"a": 4, "b": 2}
    assert index.apply(events("a", 2, removed=[CHAIN[1]]))
    assert index.matches(CHAIN) == {"a": 1, "b": 2}


def test_a_gap_puts_the_instance_out_of_sync_until_a_snapshot():
    index = GlobalPrefixIndex()
    index.apply(events("a", 1, stored=CHAIN[:2]))
    assert not index.apply(events("a", 3, stored=CHAIN[2:4]))  # event 2 was lost
    assert index.out_of_sync == {"a"} and index.matched_blocks("a", CHAIN) == 2  # kept, stale
    assert not index.apply(events("a", 4, stored=CHAIN[4:5]))  # nothing more until the snapshot
    assert index.restore(KvCacheSnapshot("a", 4, 16, CHAIN[:5]))
    assert not index.out_of_sync and index.matched_blocks("a", CHAIN) == 5
    assert index.apply(events("a", 5, cleared=True, stored=CHAIN[:1]))
    assert index.matched_blocks("a", CHAIN) == 1
    # A restarted llumlet's first snapshot (seq 0) replaces what the index held of it.
    assert index.restore(KvCacheSnapshot("a", 0, 16, CHAIN[:2])) and index.matched_blocks("a", CHAIN) == 2
    assert index.apply(events("a", 1, stored=CHAIN[2:3])) and index.matched_blocks("a", CHAIN) == 3


def test_an_instance_heard_mid_stream_or_restarted_needs_a_snapshot():
    index = GlobalPrefixIndex()
    assert not index.apply(events("a", 40, stored=CHAIN[:2]))  # a new scheduler, an old llumlet
    assert index.out_of_sync == {"a"} and index.matched_blocks("a", CHAIN) == 0
    assert index.restore(KvCacheSnapshot("a", 40, 16, CHAIN[:3])) and index.apply(events("a", 41))
    assert not index.apply(events("a", 1, stored=CHAIN[:1]))  # the llumlet restarted: seq from 1
    assert index.restore(KvCacheSnapshot("a", 0, 16, []))  # its first snapshot wins, though older
    assert index.matched_blocks("a", CHAIN) == 0 and index.apply(events("a", 1, stored=CHAIN[:1]))


def test_forgetting_an_instance_leaves_nothing_of_it():
    index = GlobalPrefixIndex()
    index.apply(events("a", 1, stored=CHAIN))
    index.apply(events("b", 1, stored=CHAIN[:1]))
    index.forget("a")
    assert index.matches(CHAIN) == {"b": 1} and index.size == 1 and index.num_blocks("a") == 0


def test_matches_equal_the_per_instance_answer_on_random_contents():
    rng = random.Random(5)
    index = GlobalPrefixIndex()
    for k in range(50):
        index.apply(events(f"i{k}", 1, stored=[h for h in CHAIN if rng.random() < 0.8]))
    found = index.matches(CHAIN)
    for k in range(50):
        assert found.get(f"i{k}", 0) == index.matched_blocks(f"i{k}", CHAIN)


def test_the_messages_round_trip():
    message = events("a", 7, stored=CHAIN, removed=CHAIN[:1], cleared=True)
    assert decode(encode(message), KvCacheEvents) == message
    snapshot = KvCacheSnapshot("a", 7, 16, CHAIN)
    assert decode(encode(snapshot), KvCacheSnapshot) == snapshot


def test_a_snapshot_matching_what_is_held_changes_nothing_even_in_parts():
    index = GlobalPrefixIndex(snapshot_part=3)
    assert index.apply(events("a", 1, stored=CHAIN))
    kept = index._holders[CHAIN[0]]
    assert index.restore(KvCacheSnapshot("a", 1, 16, CHAIN[::-1])) and index._holders[CHAIN[0]] is kept  # untouched
    # A cache past one message: its first part (the rest follows as stores) cuts no chain short meanwhile.
    assert index.restore(KvCacheSnapshot("a", 1, 16, CHAIN[:3])) and index.matches(CHAIN) == {"a": 6}
    assert index.apply(events("a", 2, stored=CHAIN[3:])) and index.matches(CHAIN) == {"a": 6}
    # Not a part, and not all that is held: the snapshot is the truth.
    assert index.restore(KvCacheSnapshot("a", 2, 16, CHAIN[:2])) and index.matches(CHAIN) == {"a": 2}
    assert index.restore(KvCacheSnapshot("a", 2, 16, CHAIN[:2] + [7])) and index.num_blocks("a") == 3


def test_a_changed_snapshot_touches_only_what_changed():
    index = GlobalPrefixIndex()
    index.apply(events("a", 1, stored=CHAIN[:4]))
    index.apply(events("b", 1, stored=CHAIN[:1]))
    kept = index._holders[CHAIN[1]]
    assert not index.apply(events("a", 3))  # a gap: the snapshot may differ
    assert index.restore(KvCacheSnapshot("a", 3, 16, CHAIN[1:3] + CHAIN[4:6]))
    assert index._holders[CHAIN[1]] is kept and index.in_sync("a")  # a block still held is not rebuilt
    assert index.matches(CHAIN) == {"b": 1} and index.matched_blocks("a", CHAIN[1:]) == 2
    assert index.num_blocks("a") == 4 and index.size == 5


def test_an_instance_is_held_to_twice_its_reported_cache():
    capacity = {"a": 10}
    index = GlobalPrefixIndex(capacity.get)
    bound = 2 * 10 + SLACK_BLOCKS
    assert index.bound("a") == bound and index.bound("x") == 2 * UNKNOWN_CAPACITY_BLOCKS + SLACK_BLOCKS
    assert GlobalPrefixIndex().bound("a") == index.bound("x")  # no capacity told: generous, not unbounded
    assert index.apply(events("a", 1, stored=range(bound)))  # (within: taken)
    assert not index.apply(events("a", 2, removed=range(10), stored=range(bound, bound + 10)))  # might pass it: a gap
    assert index.out_of_sync == index.over_bound == {"a"} and index.num_blocks("a") == bound
    assert not index.restore(KvCacheSnapshot("a", 2, 16, list(range(bound + 1))))  # refused: forgotten
    assert index.num_blocks("a") == 0 and index.size == 0 and not index.in_sync("a") and "a" in index.instances()
    assert index.restore(KvCacheSnapshot("a", 2, 16, list(range(10)))) and index.in_sync("a")
    assert not index.over_bound and index.apply(events("a", 3, cleared=True, stored=range(bound)))
