"""The dispatches (and P/D hand-offs) an instance's latest load report does not show yet
(`shared/unreported_dispatches.py`): a report built before the generate orders (the hand-offs'
PRE-ALLOCs) arrived does not wipe them from the scheduler's table, for dispatch as for admission
and hand-off answers."""

from __future__ import annotations

import time
from collections import Counter

import msgspec

from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.service import GlobalScheduler
from shared.unreported_dispatches import FORGET_AFTER_S, UnreportedDispatches
from shared.messages import DispatchRequest, HandoffQuery, InstanceRole, LoadReport
from tests.unit.policy_helpers import make_load


def report(instance_id: str, seq: int, accepted: int, total: int = 128, migrations_in: int = 0,
           role: InstanceRole = InstanceRole.MIXED) -> LoadReport:
    load = make_load(instance_id, total=total)
    return msgspec.structs.replace(load, seq=seq, sent_at=time.time(), num_accepted_total=accepted,
                                   num_migrations_asked_total=migrations_in, role=role)


def test_dispatches_are_added_back_until_accepted_orders_count_them_off_or_they_are_forgotten():
    clock = [100.0]
    unreported = UnreportedDispatches(clock=lambda: clock[0])
    first = unreported.restore(report("a", 1, accepted=5))
    assert first.num_waiting == 0  # (the first look sets the count)
    for i in range(3):
        unreported.dispatched(first, DispatchRequest(f"r{i}", 100, 4, priority=1))

    def shown(seq: int, accepted: int) -> tuple[int, int]:
        load = unreported.restore(report("a", seq, accepted))
        level = {lv.priority: lv for lv in load.by_priority}.get(1)
        assert (level.num_waiting if level else 0) == load.num_waiting  # by the dispatch's priority
        return load.num_waiting, load.waiting_demand_blocks

    assert shown(2, accepted=5) == (3, 3 * 7)  # 101 tokens: 7 blocks of 16 each
    assert shown(3, accepted=6) == (2, 2 * 7)  # one arrived
    assert shown(4, accepted=6) == (2, 2 * 7)
    clock[0] += FORGET_AFTER_S + 0.1
    assert shown(5, accepted=6) == (0, 0)  # never arrived: forgotten
    unreported.dispatched(report("a", 5, accepted=6), DispatchRequest("r9", 100, 4))
    assert shown(6, accepted=0) == (0, 0)  # it restarted: nothing it held is left


def test_a_reordered_older_report_is_dropped_before_it_counts_back_anything():
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    s.take_report(report("a", 1, accepted=0, total=1000))
    for i in range(3):
        assert s.decide(DispatchRequest(f"r{i}", 100, 4)).instance_id == "a"
    s.take_report(report("a", 3, accepted=1))  # one arrived
    assert s.table.get("a").num_waiting == 2
    s.take_report(report("a", 2, accepted=0))  # reordered: dropped by the table, and not restored
    s.take_report(report("a", 4, accepted=1))
    assert s.table.get("a").num_waiting == 2  # (restored, the stale count would have counted off one more)


def test_a_burst_stays_spread_when_reports_built_before_its_orders_arrive():
    """Two equal instances, and after each dispatch a report from `a` built before any order
    reached it: without adding the dispatches back, each one makes `a` look empty again, and the
    burst piles onto it."""
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    for iid in ("a", "b"):
        s.take_report(report(iid, 1, accepted=0, total=1000))
    chosen = []
    for i in range(12):
        chosen.append(s.decide(DispatchRequest(f"r{i}", 300, 16)).instance_id)
        s.take_report(report("a", 2 + i, accepted=0, total=1000))
    assert Counter(chosen) == Counter({"a": 6, "b": 6}), chosen


def test_an_instance_that_left_is_forgotten():
    unreported = UnreportedDispatches()
    load = unreported.restore(report("a", 1, accepted=0))
    unreported.dispatched(load, DispatchRequest("r0", 100, 4))
    unreported.forget("a")
    assert unreported.restore(report("a", 2, accepted=0)).num_waiting == 0


def test_handoffs_are_added_back_until_the_instance_answers_their_migrations():
    clock = [100.0]
    unreported = UnreportedDispatches(clock=lambda: clock[0])
    first = unreported.restore(report("d", 1, accepted=0, migrations_in=3))
    for _ in range(2):
        unreported.handed_off(first, 10)

    def reserved(seq: int, migrations_in: int, accepted: int = 0) -> tuple[int, int, int]:
        load = unreported.restore(report("d", seq, accepted, migrations_in=migrations_in))
        return load.num_blocks_free, load.reserved_blocks, load.num_migrating

    assert reserved(2, migrations_in=3) == (108, 20, 2)  # (128 free, as make_load builds it)
    assert reserved(3, migrations_in=3, accepted=4) == (108, 20, 2)  # generate orders count off none
    assert reserved(4, migrations_in=4) == (118, 10, 1)  # one answered: its blocks show (or never will)
    clock[0] += FORGET_AFTER_S + 0.1
    assert reserved(5, migrations_in=4) == (128, 0, 0)  # never asked there: forgotten


def test_handoffs_answered_together_spread_when_a_report_built_before_them_lands():
    """Two equal decode instances, and after each answer a report from `d1` built before any
    PRE-ALLOC reached it: without adding the hand-offs back, each one makes `d1` look empty
    again, and the hand-offs pile onto it."""
    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    s.take_report(report("p", 1, accepted=0, role=InstanceRole.PREFILL))
    for iid in ("d1", "d2"):
        s.take_report(report(iid, 1, accepted=0, total=1000, role=InstanceRole.DECODE))
    chosen = []
    for i in range(8):
        chosen.append(s.roles.handoff(HandoffQuery("p", f"r{i}", 40)).dst_instance_id)
        s.take_report(report("d1", 2 + i, accepted=0, total=1000, role=InstanceRole.DECODE))
    assert Counter(chosen) == Counter({"d1": 4, "d2": 4}), chosen


def test_a_restored_dispatch_counts_back_the_prefill_it_will_do_there():
    clock = [100.0]
    unreported = UnreportedDispatches(clock=lambda: clock[0])
    told = msgspec.structs.replace(report("a", 1, accepted=0), waiting_prefill_tokens=50)
    first = unreported.restore(told)
    unreported.dispatched(first, DispatchRequest("r0", 100, 4), cached_tokens=64)  # 36 to prefill there
    later = msgspec.structs.replace(report("a", 2, accepted=0), waiting_prefill_tokens=10)
    assert unreported.restore(later).waiting_prefill_tokens == 10 + 36
    # An instance that does not tell it (no prefix cache, an older llumlet) stays untold.
    assert unreported.restore(report("a", 3, accepted=0)).waiting_prefill_tokens is None


def test_the_scheduler_counts_into_the_holders_queue_only_the_prefill_it_will_do_there():
    from shared.messages import KvCacheSnapshot

    s = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222", dispatch_policy="corral-prefix"))
    for iid in ("a", "b"):
        s.take_report(msgspec.structs.replace(report(iid, 1, accepted=0, total=1000), waiting_prefill_tokens=0))
    chain = list(range(1, 21))  # 20 blocks of 16 tokens: the prompt's first 320
    s.prefixes.index.restore(KvCacheSnapshot("b", 0, 16, chain))
    req = DispatchRequest("r0", 325, 4, block_hashes=chain, prefix_block_size=16)
    assert s.decide(req).instance_id == "b"
    assert s.table.get("b").waiting_prefill_tokens == 5  # not 325: the prefix is cached there
    s.take_report(msgspec.structs.replace(report("b", 2, accepted=0, total=1000), waiting_prefill_tokens=0))
    assert s.table.get("b").waiting_prefill_tokens == 5  # restored on a report that does not show it yet
