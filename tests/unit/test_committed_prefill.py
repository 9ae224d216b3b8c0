"""Blocks an admitted prompt still has to claim (v1: admitted on its whole sequence, allocated
chunk by chunk) are spoken for: the engine's admission and leases, the load report's virtual
usage and the destination guard all count them."""

from __future__ import annotations

from shared.engine_model.config import SchedulerConfig
from shared.engine_model.queues import select_victim
from shared.engine_model.request import SimRequest
from shared.engine_model.scheduler import SimScheduler
from shared.messages import LoadReport
from shared.policy.freeness import QueueDemand, total_virtual_usage
from shared.policy.migration import MigrationGuard, is_migratable, may_migrate_into, may_move


def scheduler() -> SimScheduler:
    # 100 blocks of 16 tokens, 256-token chunks.
    return SimScheduler(SchedulerConfig(num_blocks=100, max_num_batched_tokens=256, max_model_len=1600))


def admit_long_prompt(s: SimScheduler) -> SimRequest:
    s.add_request(SimRequest("long", 1000, max_tokens=4))  # 63 blocks, 16 of them in the first chunk
    s.update_from_output(s.schedule())
    return s.get("long")


def test_an_admitted_prompt_owes_its_remaining_blocks_until_its_last_chunk():
    s = scheduler()
    request = admit_long_prompt(s)
    assert request.num_computed_tokens == 256 and s.block_manager.num_free == 84
    assert s.committed_blocks() == 63 - 16
    while request.num_computed_tokens < request.prompt_len:
        s.update_from_output(s.schedule())
    assert s.committed_blocks() == 0


def test_a_lease_may_not_take_owed_blocks_and_without_that_rule_the_next_chunk_preempts():
    s = scheduler()
    admit_long_prompt(s)
    s.add_request(SimRequest("short", 100, max_tokens=200))  # decodes on, growing
    s.update_from_output(s.schedule())
    free, owed = s.block_manager.num_free, s.committed_blocks()
    assert s.reserve("lease", free - owed + 1) is None  # would eat what "long" still needs
    assert s.reserve("lease", free - owed) is not None
    # The fix off: the same lease taken from the raw free pool (what a lease did before).
    unfixed = scheduler()
    admit_long_prompt(unfixed)
    unfixed.add_request(SimRequest("short", 100, max_tokens=200))
    unfixed.update_from_output(unfixed.schedule())
    assert unfixed.block_manager.reserve("lease", unfixed.block_manager.num_free) is not None
    for target in (s, unfixed):
        for _ in range(10):
            target.update_from_output(target.schedule())
    assert s.num_preemptions_total == 0
    assert unfixed.num_preemptions_total > 0


def test_admission_counts_what_admitted_prompts_still_owe():
    s = scheduler()
    admit_long_prompt(s)  # 84 free, 47 owed
    s.add_request(SimRequest("second", 600, max_tokens=4))  # 38 blocks: fits 84, not 84 - 47
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["long"]


def report(**changes) -> LoadReport:
    fields = dict(instance_id="i", seq=1, sent_at=0.0, num_blocks_total=1000, num_blocks_free=500, block_size=16,
                  num_running=1, num_waiting=0, head_demand_blocks=0, waiting_demand_blocks=0,
                  num_preemptions_total=0)
    return LoadReport(**(fields | changes))


def test_virtual_usage_and_the_guard_count_committed_blocks():
    assert total_virtual_usage(report(committed_blocks=120), {}, QueueDemand.HEAD) == 120
    guard = MigrationGuard(dest_min_free_fraction_after=0.1)
    args = dict(num_blocks=300, num_blocks_free=500, num_blocks_total=1000, num_waiting=0, guard=guard)
    assert may_migrate_into(**args)
    assert not may_migrate_into(**args, num_blocks_committed=150)


def test_a_request_in_prefill_or_recovering_is_never_a_candidate():
    assert is_migratable(num_output_tokens=3, num_computed_tokens=102, num_tokens=103, recovering=False)
    assert not is_migratable(num_output_tokens=0, num_computed_tokens=50, num_tokens=100, recovering=False)
    assert not is_migratable(num_output_tokens=3, num_computed_tokens=40, num_tokens=103, recovering=False)
    assert not is_migratable(num_output_tokens=3, num_computed_tokens=102, num_tokens=103, recovering=True)


def test_residence_and_return_trip_limits():
    guard = MigrationGuard(min_residence_s=1.0, min_return_s=30.0)
    assert not may_move(residence_s=0.5, left_destination_s_ago=None, guard=guard)
    assert may_move(residence_s=2.0, left_destination_s_ago=None, guard=guard)
    assert not may_move(residence_s=2.0, left_destination_s_ago=10.0, guard=guard)
    assert may_move(residence_s=2.0, left_destination_s_ago=31.0, guard=guard)


def test_priority_victim_with_one_level_is_fcfs_victim():
    old = SimRequest("old-migrated-in", 10, 10, arrival_time=0.0)
    new = SimRequest("new-local", 10, 10, arrival_time=5.0)
    running = [new, old]  # the migrated-in request joined the batch last
    assert select_victim("priority", running) is select_victim("fcfs", running) is old
    high = SimRequest("high", 10, 10, priority=-1, arrival_time=9.0)
    assert select_victim("priority", [new, high]) is new  # a less important level goes first
