"""Cache-aware pairing (issue 18 §4): a destination holding the moving request's prefix is
preferred among those the bands and the guard admit, within a bounded loss of freeness."""

from __future__ import annotations

import random

import pytest

from services.global_scheduler.migration_loop import MigrationPairer
from shared.messages import KvCacheSnapshot
from shared.policy.config import PolicyConfig
from shared.policy.freeness import QueueDemand, freeness
from shared.policy.migration import DEFAULT_GUARD, CacheAffinity, MigrationGuard, MigrationPair, pair_migrations
from shared.prefix_index import GlobalPrefixIndex
from tests.unit.policy_helpers import make_load

CONFIG = PolicyConfig(headroom_blocks={}, migrate_out_freeness=1.0, migrate_in_freeness=10.0)


def _cluster():
    return [
        make_load("src", total=100, running={0: (10, 95)}),  # F = 0.5
        make_load("freest", total=100, running={0: (2, 20)}),  # F = 40
        make_load("warm", total=100, running={0: (2, 40)}),  # F = 30
        make_load("cold", total=100, running={0: (2, 70)}),  # F = 15
    ]


def test_destination_holding_the_prefix_wins_within_the_bound():
    cached = {"warm": 12, "cold": 30}  # cold holds more, but 15 < 40 - 0.5 * 40
    assert pair_migrations(_cluster(), CONFIG, None, lambda src: cached) == [MigrationPair("src", "warm")]


def test_the_bound_keeps_affinity_from_taking_a_much_fuller_destination():
    cached = {"cold": 30}
    assert pair_migrations(_cluster(), CONFIG, None, lambda src: cached) == [MigrationPair("src", "freest")]
    loose = CacheAffinity(max_freeness_loss=0.7)  # floor 12: cold (15) competes now
    assert pair_migrations(_cluster(), CONFIG, None, lambda src: cached, loose) == [MigrationPair("src", "cold")]


def test_no_affinity_loss_is_a_tie_break_only():
    strict = CacheAffinity(max_freeness_loss=0.0)
    assert pair_migrations(_cluster(), CONFIG, None, lambda src: {"warm": 50}, strict) == [MigrationPair("src", "freest")]
    loads = _cluster() + [make_load("twin", total=100, running={0: (2, 20)})]  # as free as "freest"
    assert pair_migrations(loads, CONFIG, None, lambda src: {"twin": 3}, strict) == [MigrationPair("src", "twin")]


def test_equal_hits_stay_with_the_freer_destination():
    cached = {"freest": 8, "warm": 8}
    assert pair_migrations(_cluster(), CONFIG, None, lambda src: cached) == [MigrationPair("src", "freest")]


def test_never_a_destination_the_guard_refuses():
    loads = _cluster() + [make_load("queued", total=100, running={0: (1, 10)}, waiting=[5])]  # F = 85, 1 waiting
    guard = MigrationGuard(min_freeness_gap=25.0)  # warm (30 - 0.5 = 29.5) keeps the gap; cold does not
    cached = {"queued": 40, "cold": 40, "warm": 1}
    pairs = pair_migrations(loads, CONFIG, guard, lambda src: cached, CacheAffinity(max_freeness_loss=0.9))
    assert pairs == [MigrationPair("src", "warm")]  # queued: refused for its queue; cold: below the gap


def test_each_source_asks_for_its_own_request():
    loads = [
        make_load("s1", total=100, running={0: (10, 100)}, waiting=[40]),  # F = -4
        make_load("s2", total=100, running={0: (10, 95)}),  # F = 0.5
        make_load("d1", total=100, running={0: (2, 20)}),  # F = 40
        make_load("d2", total=100, running={0: (2, 30)}),  # F = 35
    ]
    asked = []

    def cached(src: str) -> dict[str, int]:
        asked.append(src)
        return {"d2": 4} if src == "s1" else {"d1": 4}

    assert pair_migrations(loads, CONFIG, None, cached) == [MigrationPair("s1", "d2"), MigrationPair("s2", "d1")]
    assert asked == ["s1", "s2"]


@pytest.mark.parametrize("seed", range(20))
def test_without_hits_pairing_is_the_freeness_pairing(seed):
    rng = random.Random(seed)
    loads = []
    for i in range(rng.randint(2, 12)):
        n = rng.randint(0, 8)
        loads.append(make_load(f"i{i}", total=100, running={0: (n, rng.randint(n, 100))} if n else None,
                               waiting=[rng.randint(1, 30)] if rng.random() < 0.2 else None))
    guard = MigrationGuard(min_freeness_gap=rng.choice([0.0, 10.0]))
    plain = pair_migrations(loads, CONFIG, guard)
    assert pair_migrations(loads, CONFIG, guard, lambda src: {}) == plain
    # Hits may change which destination a source gets (and so leave a freer one to the next
    # source), never the bands, the queue rule or the guard's gap.
    hits = {l.instance_id: rng.randint(0, 5) for l in loads}
    affine = pair_migrations(loads, CONFIG, guard, lambda src: hits)
    assert [p.src for p in affine][:len(plain)] == [p.src for p in plain]
    f = {l.instance_id: freeness(l, CONFIG.headroom_blocks, QueueDemand.HEAD) for l in loads}
    by_id = {l.instance_id: l for l in loads}
    for pair in affine:
        assert f[pair.src] < CONFIG.migrate_out_freeness and f[pair.dst] > CONFIG.migrate_in_freeness
        assert f[pair.dst] - f[pair.src] >= guard.min_freeness_gap
        assert by_id[pair.dst].num_waiting <= guard.dest_max_waiting


def test_affinity_bound_is_validated():
    with pytest.raises(ValueError):
        CacheAffinity(max_freeness_loss=1.0)


# -- the live scheduler's pairer: the source's report names its next request's prefix ----------


def _migratable(load, hashes=()):
    load.kv_address = f"127.0.0.1:{abs(hash(load.instance_id)) % 50000 + 1024}"
    load.migration_candidate_hashes = list(hashes)
    return load


def _pairer_cluster(hashes=()):
    return [
        _migratable(make_load("src", total=100, running={0: (10, 98)}), hashes),  # F = 0.2
        _migratable(make_load("freest", total=100, running={0: (1, 5)})),  # F = 95
        _migratable(make_load("warm", total=100, running={0: (1, 20)})),  # F = 80
    ]


def test_the_scheduler_pairs_a_source_with_the_destination_caching_its_next_request():
    index = GlobalPrefixIndex()
    index.restore(KvCacheSnapshot("warm", 1, 16, [11, 12, 13]))
    pairer = MigrationPairer(CONFIG, DEFAULT_GUARD, index)
    [order] = pairer.plan(_pairer_cluster(hashes=[11, 12, 13, 14]))
    assert (order.src, order.message.dst_instance_id) == ("src", "warm")


def test_without_candidate_hashes_or_an_index_the_scheduler_pairs_by_freeness():
    index = GlobalPrefixIndex()
    index.restore(KvCacheSnapshot("warm", 1, 16, [11, 12, 13]))
    [order] = MigrationPairer(CONFIG, DEFAULT_GUARD, index).plan(_pairer_cluster())
    assert order.message.dst_instance_id == "freest"
    [order] = MigrationPairer(CONFIG, DEFAULT_GUARD).plan(_pairer_cluster(hashes=[11, 12]))
    assert order.message.dst_instance_id == "freest"
