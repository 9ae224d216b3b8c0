"""The shared local scheduler: preemption (by recompute, by priority) and the v0 step mode."""

from __future__ import annotations

import pytest

from shared.engine_model.views import RequestPhase
from shared.engine_model.request import RequestStatus
from shared.engine_model.scheduler import SimScheduler
from tests.unit.sim_scheduler_helpers import make, req, run_until_idle, scheduled, step


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 8 blocks of 4 tokens: two requests of 12-token prompts fill 6 blocks and outgrow the rest.
    s = make(num_blocks=8, max_num_batched_tokens=64)
    s.add_request(first := req("first", prompt=12, output=12, arrival=0))
    s.add_request(last := req("last", prompt=12, output=12, arrival=1))
    preempted: list[str] = []
    produced: dict[str, int] = {}
    for i in range(500):
        if not s.has_work():
            break
        out, new, _ = step(s, now=i)
        preempted += [r.request_id for r in out.preempted]
        for rid in new:
            produced[rid] = produced.get(rid, 0) + 1
    assert preempted and set(preempted) == {"last"}  # FCFS: the last in running order
    assert last.num_preemptions == len(preempted) and first.num_preemptions == 0
    assert s.num_preemptions_total == len(preempted)
    assert produced == {"first": 12, "last": 12}
    assert last.num_recomputed_tokens > 0 and last.preemption_loss_s > 0
    assert s.block_manager.num_free == 8


def test_preempted_request_goes_to_the_front_of_the_queue_and_loses_its_kv() -> None:
    s = make(num_blocks=8, max_num_batched_tokens=64)
    s.add_request(req("a", prompt=16, output=20, arrival=0))
    s.add_request(b := req("b", prompt=12, output=20, arrival=1))
    step(s)
    s.add_request(req("c", prompt=4, output=4, arrival=2))
    while b.num_preemptions == 0:
        step(s)
    assert s.waiting.peek() is b
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert not s.block_manager.has_owner("b")
    views = s.request_views()
    assert views[0].request_id == "b" and views[0].phase is RequestPhase.WAITING
    assert views[0].demand_blocks == -(-(b.num_tokens + 1) // 4)


def test_priority_policy_preempts_the_least_important_request() -> None:
    s = make(num_blocks=8, max_num_batched_tokens=64, queue_policy="priority")
    s.add_request(normal := req("normal", prompt=12, output=20, priority=0, arrival=0))
    step(s)
    s.add_request(high := req("high", prompt=12, output=20, priority=-1, arrival=1))
    run_until_idle(s)
    assert normal.num_preemptions > 0 and high.num_preemptions == 0
    assert high.finished_time < normal.finished_time


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make(num_blocks=6, max_num_batched_tokens=64, queue_policy="priority")
    s.add_request(req("a", prompt=8, output=30, arrival=0))
    s.add_request(req("b", prompt=8, output=30, arrival=1))
    step(s)
    step(s)  # both hold 3 blocks now: nothing is free
    s.add_request(small := req("small", prompt=1, output=2, priority=-1, arrival=2))
    for _ in range(20):
        out = s.schedule()
        if out.preempted:
            break
        assert small.status == RequestStatus.WAITING
        s.update_from_output(out)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert small not in out.requests and s.block_manager.num_free > 0  # it would fit, but waits
    s.update_from_output(out)
    assert small in s.schedule().requests


def fill_with_running_requests(mode: str = "v1", first_priority: int = 0, **overrides) -> SimScheduler:
    """8 blocks of 4 tokens: three running requests of 10 + 6 + 6 prompt tokens (arrivals 0, 1,
    2) hold 3 + 2 + 2 blocks, and their next decode fits the blocks they hold."""
    s = make(num_blocks=8, max_num_batched_tokens=64, queue_policy="priority", step_mode=mode, **overrides)
    for rid, prompt, arrival in (("n0", 10, 0), ("n1", 6, 1), ("n2", 6, 2)):
        s.add_request(req(rid, prompt=prompt, output=30, arrival=arrival, priority=first_priority if rid == "n0" else 0))
    step(s)
    assert s.block_manager.num_free == 1 and len(s.running) == 3
    return s


@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_waiting_high_priority_preempts_the_least_important_running_requests(mode: str) -> None:
    s = fill_with_running_requests(mode)
    s.add_request(high := req("high", prompt=16, output=2, priority=-1, arrival=3))  # 4 blocks
    out, _, _ = step(s, now=1.0)
    # The latest arrival goes first (3 free blocks then), then the next latest (5): enough.
    assert [r.request_id for r in out.preempted] == ["n2", "n1"]
    assert high not in out.requests and "n0" in scheduled(out)
    out, _, _ = step(s, now=2.0)
    assert scheduled(out)["high"] == 16
    assert high.num_preemptions == 0 and s.get("n0").num_preemptions == 0


def test_equal_priorities_never_preempt_each_other_from_the_queue() -> None:
    s = fill_with_running_requests()
    s.add_request(req("late", prompt=12, output=2, arrival=3))
    out, _, _ = step(s, now=1.0)
    assert not out.preempted and s.get("late").status == RequestStatus.WAITING


def test_nothing_is_preempted_when_even_all_lower_priority_requests_would_not_make_room() -> None:
    s = fill_with_running_requests(first_priority=-1)
    s.add_request(req("big", prompt=24, output=2, priority=-1, arrival=3))  # 6 blocks: 1 free + 4
    out, _, _ = step(s, now=1.0)
    assert not out.preempted and s.num_preemptions_total == 0


def test_fcfs_queue_and_the_switch_turn_priority_preemption_off() -> None:
    s = fill_with_running_requests(preempt_for_priority=False)
    s.add_request(req("high", prompt=12, output=2, priority=-1, arrival=3))
    out, _, _ = step(s, now=1.0)
    assert not out.preempted
    s = make(num_blocks=8, max_num_batched_tokens=64)
    for rid, prompt in (("n0", 10), ("n1", 6), ("n2", 6)):
        s.add_request(req(rid, prompt=prompt, output=30))
    step(s)
    s.add_request(req("high", prompt=12, output=2, priority=-1))
    out, _, _ = step(s)
    assert not out.preempted


def test_a_full_batch_of_sequences_makes_room_for_a_high_priority_request() -> None:
    s = make(max_num_seqs=2, queue_policy="priority")
    s.add_request(req("n0", prompt=4, output=30, arrival=0))
    s.add_request(req("n1", prompt=4, output=30, arrival=1))
    step(s)
    s.add_request(req("high", prompt=4, output=2, priority=-1, arrival=2))
    out, _, _ = step(s)
    assert [r.request_id for r in out.preempted] == ["n1"]
    out, _, _ = step(s)
    assert "high" in scheduled(out) and len(s.running) == 2


def test_v0_prefill_step_stalls_the_running_batch() -> None:
    s = make(step_mode="v0")
    s.add_request(req("a", prompt=20, output=10))
    out, _, _ = step(s)
    assert scheduled(out) == {"a": 20}
    s.add_request(req("b", prompt=30, output=10))
    out, _, _ = step(s)
    assert scheduled(out) == {"b": 30}  # no decode for "a" in a prefill step
    assert out.decode_batch_size == 0
    out, _, _ = step(s)
    assert scheduled(out) == {"a": 1, "b": 1}
    assert out.prefill_tokens == 0 and out.decode_batch_size == 2


def test_v0_prefills_whole_prompts_within_the_budget() -> None:
    s = make(step_mode="v0", max_num_batched_tokens=50, max_model_len=256)
    s.add_request(req("big", prompt=120, output=2))  # above the budget: admitted alone
    s.add_request(req("x", prompt=20, output=2))
    s.add_request(req("y", prompt=20, output=2))
    s.add_request(req("z", prompt=20, output=2))
    out, _, _ = step(s)
    assert scheduled(out) == {"big": 120}
    out, _, _ = step(s)
    assert scheduled(out) == {"x": 20, "y": 20}
    produced = run_until_idle(s)
    assert sum(produced.values()) == 8 - 3  # big, x, y already sampled one token each


def test_v0_and_v1_produce_the_same_tokens_overall() -> None:
    totals = []
    for mode in ("v0", "v1"):
        s = make(step_mode=mode, num_blocks=32)
        for i in range(12):
            s.add_request(req(f"r{i}", prompt=3 + 5 * i, output=2 + 3 * i, arrival=i))
        totals.append(run_until_idle(s))
        assert s.block_manager.num_free == 32
    assert totals[0] == totals[1] == {f"r{i}": 2 + 3 * i for i in range(12)}
