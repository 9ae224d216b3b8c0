"""The named policies (shared/policy/baselines.py) as pure functions over load reports."""

from __future__ import annotations

import pytest

from shared.messages import DispatchRequest
from shared.policy.baselines import (
    POLICY_NAMES,
    choose_least_loaded,
    choose_round_robin,
    get_policy,
    memory_load,
)
from shared.policy.config import HIGH_PRIORITY, PolicyConfig
from shared.policy.dispatch import choose_instance, dispatch_score
from shared.policy.freeness import QueueDemand, freeness
from shared.policy.migration import MigrationGuard, MigrationPair, may_migrate_into, pair_migrations
from tests.unit.policy_helpers import make_load

CONFIG = PolicyConfig(headroom_blocks={}, migrate_out_freeness=1.0, migrate_in_freeness=10.0)


def request(request_id: str = "r1", tokens: int = 32) -> DispatchRequest:
    return DispatchRequest(request_id=request_id, num_prompt_tokens=tokens, max_tokens=16)


def test_policies_by_name():
    assert POLICY_NAMES == ("round-robin", "infaas++", "llumnix-base", "corral")
    assert get_policy(" Corral ").priorities and get_policy("corral").migration
    assert not get_policy("llumnix-base").priorities and get_policy("llumnix-base").migration
    assert not get_policy("infaas++").migration
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        get_policy("fifo")


def test_a_policy_without_priorities_has_no_headroom_and_one_priority():
    base = PolicyConfig(headroom_blocks={HIGH_PRIORITY: 100})
    assert get_policy("llumnix-base").policy_config(base).headroom_blocks == {}
    assert get_policy("corral").policy_config(base).headroom_blocks == {HIGH_PRIORITY: 100}
    assert get_policy("llumnix-base").effective_priority(HIGH_PRIORITY) == 0
    assert get_policy("corral").queue_policy == "priority" and get_policy("infaas++").queue_policy == "fcfs"


def test_infaas_counts_queued_demand_in_memory_load():
    queued = make_load("queued", total=100, running={0: (1, 20)}, waiting=[50])  # 70 % claimed
    busy = make_load("busy", total=100, running={0: (10, 60)})  # 60 %, but a large batch
    assert memory_load(queued) == pytest.approx(0.7)
    assert choose_least_loaded([queued, busy], request()).instance_id == "busy"
    assert memory_load(make_load("d", draining=True)) == float("inf")


def test_infaas_never_picks_a_draining_instance_while_another_serves():
    loads = [make_load("drain", draining=True), make_load("full", running={0: (5, 99)})]
    assert choose_least_loaded(loads, request()).instance_id == "full"


def test_round_robin_takes_turns_over_live_instances_in_id_order():
    loads = [make_load("b"), make_load("a"), make_load("c", draining=True)]
    assert [choose_round_robin(loads, request(), turn).instance_id for turn in range(4)] == ["a", "b", "a", "b"]


def test_rejections_are_those_of_choose_instance():
    too_long = request(tokens=5000)
    loads = [make_load("a", max_model_len=4096)]
    for decision in (choose_round_robin(loads, too_long, 0), choose_least_loaded(loads, too_long)):
        assert decision == choose_instance(loads, too_long, CONFIG)
    assert choose_least_loaded([], request()).rejected == "no instance is available"


def test_queued_requests_count_in_the_batch_a_dispatch_score_divides_by():
    # One long prompt prefilling: by freeness per running request the instance looks empty.
    prefilling = make_load("prefilling", total=100, running={0: (1, 40)}, waiting=[2, 2, 2])  # 54 / 4
    steady = make_load("steady", total=100, running={0: (4, 40)})  # 60 / 4
    # Plain freeness (per running request) prefers the instance stuck behind a prefill...
    assert freeness(prefilling, {}, QueueDemand.ALL) > freeness(steady, {}, QueueDemand.ALL)
    # ...the dispatch score, per request held, does not.
    assert dispatch_score(prefilling, {}) == pytest.approx(13.5)
    assert choose_instance([prefilling, steady], request(), CONFIG).instance_id == "steady"


def test_overloaded_instances_rank_by_deficit_not_by_deficit_per_request():
    big_batch = make_load("big", total=100, running={0: (40, 90)}, waiting=[60])  # deficit 50, F = -1.25
    small_batch = make_load("small", total=100, running={0: (2, 90)}, waiting=[20])  # deficit 10, F = -5
    assert dispatch_score(big_batch, {}) == -50 and dispatch_score(small_batch, {}) == -10
    # Plain freeness ranks the bigger deficit higher (the flaw the score fixes).
    assert freeness(big_batch, {}, QueueDemand.ALL) > freeness(small_batch, {}, QueueDemand.ALL)
    assert choose_instance([big_batch, small_batch], request(), CONFIG).instance_id == "small"
    roomy = make_load("roomy", total=100, running={0: (50, 99)})  # F = 0.02 >= any deficit
    assert choose_instance([big_batch, small_batch, roomy], request(), CONFIG).instance_id == "roomy"


def test_guard_skips_destinations_with_a_queue_and_small_gaps():
    fragmented = make_load("frag", total=100, running={0: (2, 50)}, waiting=[60])  # F = -5
    idle_with_queue = make_load("queued", total=100, running={0: (1, 10)}, waiting=[5])  # F = 85, queue
    light = make_load("light", total=100, running={0: (2, 40)})  # F = 30
    guard = MigrationGuard()
    assert pair_migrations([fragmented, idle_with_queue, light], CONFIG, guard) == [MigrationPair("frag", "light")]
    nearly = make_load("nearly", total=100, running={0: (10, 92)})  # F = 0.8, a source
    barely = make_load("barely", total=100, running={0: (5, 45)})  # F = 11, a destination, gap 10.2
    assert pair_migrations([nearly, barely], CONFIG, guard) == [MigrationPair("nearly", "barely")]
    assert pair_migrations([nearly, barely], CONFIG, MigrationGuard(min_freeness_gap=20)) == []


def test_destination_keeps_a_margin_after_taking_a_request():
    guard = MigrationGuard(dest_min_free_fraction_after=0.1)
    dest = dict(num_blocks_free=50, num_blocks_total=100, num_waiting=0, guard=guard)
    assert may_migrate_into(num_blocks=40, **dest)
    assert not may_migrate_into(num_blocks=41, **dest)
    assert not may_migrate_into(num_blocks=1, num_blocks_free=95, num_blocks_total=100, num_waiting=1, guard=guard)
    assert not may_migrate_into(num_blocks=1, **dest, draining=True)
