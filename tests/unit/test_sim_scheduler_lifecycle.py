"""The shared local scheduler: abort, the migration hooks, load views, and a randomized run that keeps
every invariant."""

from __future__ import annotations

import dataclasses
import random

import pytest

from shared.engine_model.views import EngineError, RequestPhase
from shared.engine_model.request import RequestStatus, SimRequest
from shared.engine_model.load_report import aggregate_views
from shared.messages import FinishReason
from tests.unit.sim_scheduler_helpers import make, req, run_until_idle, step


def test_abort_waiting_running_and_suspended_frees_blocks() -> None:
    s = make(max_num_seqs=2)
    for rid in ("run", "sus", "wait"):
        s.add_request(req(rid, prompt=12, output=10))
    step(s)
    assert s.get("wait").status == RequestStatus.WAITING
    assert s.suspend("sus")
    for rid in ("run", "sus", "wait"):
        aborted = s.abort_request(rid)
        assert aborted is not None and aborted.status == RequestStatus.FINISHED_ABORTED
        assert s.abort_request(rid) is None  # idempotent
        s.check_invariants()
    assert s.block_manager.num_free == 64 and not s.has_work()


def test_abort_while_a_step_runs_discards_its_work() -> None:
    s = make()
    s.add_request(req("r", prompt=8, output=4))
    out = s.schedule()
    s.abort_request("r")
    events = s.update_from_output(out)
    assert events.new_token == [] and events.finished == []
    assert s.block_manager.num_free == 64
    s.check_invariants()


def test_suspended_request_keeps_blocks_and_is_not_scheduled() -> None:
    s = make()
    s.add_request(r := req("r", prompt=10, output=10))
    step(s)
    blocks = s.block_ids_of("r")
    assert s.suspend("r") and not s.suspend("r")
    out, _, _ = step(s)
    assert out.is_empty and s.block_ids_of("r") == blocks
    assert [v.phase for v in s.request_views()] == [RequestPhase.RUNNING]
    assert s.resume("r") and not s.resume("r")
    run_until_idle(s)
    assert r.num_output_tokens == 10


def test_release_migrated_frees_blocks_without_output() -> None:
    s = make()
    s.add_request(r := req("r", prompt=10, output=10))
    step(s)
    assert not s.release_migrated("r")  # only a suspended request can be released
    s.suspend("r")
    assert s.release_migrated("r")
    assert r.status == RequestStatus.FINISHED_MIGRATED and r.finish_reason is None
    assert s.block_manager.num_free == 64 and not s.has_work()
    s.check_invariants()


def test_add_migrated_continues_from_the_copied_state() -> None:
    src, dst = make(), make()
    src.add_request(r := req("r", prompt=10, output=10))
    for _ in range(4):
        step(src)
    src.suspend("r")
    lease = dst.reserve("mig-1", len(src.block_ids_of("r")))
    assert lease is not None
    moved = req("r", prompt=10, output=10)
    moved.num_output_tokens, moved.num_computed_tokens = r.num_output_tokens, r.num_computed_tokens
    dst.add_migrated(moved, "mig-1")
    assert src.release_migrated("r")
    dst.check_invariants()
    assert dst.block_ids_of("r") == lease and dst.block_manager.num_reserved == 0
    produced = run_until_idle(dst)
    assert produced == {"r": 10 - 4} and moved.finish_reason is FinishReason.LENGTH
    assert dst.block_manager.num_free == 64 and src.block_manager.num_free == 64


def test_add_migrated_refuses_a_lease_that_is_too_small() -> None:
    s = make()
    s.reserve("lease", 1)
    moved = req("r", prompt=10, output=10)
    moved.num_output_tokens, moved.num_computed_tokens = 2, 11
    with pytest.raises(EngineError, match="too few"):
        s.add_migrated(moved, "lease")
    assert s.block_manager.num_reserved == 1 and s.get("r") is None


def test_reserved_blocks_hold_back_admission_until_released() -> None:
    s = make(num_blocks=8)
    assert s.reserve("lease", 6) is not None
    s.add_request(req("r", prompt=12, output=2))
    out, _, _ = step(s)
    assert out.is_empty and s.has_work()
    s.release("lease")
    assert run_until_idle(s) == {"r": 2}


def test_request_views_list_waiting_in_order_then_running() -> None:
    s = make(max_num_batched_tokens=12, queue_policy="priority")
    s.add_request(req("run", prompt=12, output=5, arrival=0))
    step(s)
    s.add_request(req("normal", prompt=7, output=5, priority=0, arrival=1))
    s.add_request(req("high", prompt=8, output=5, priority=-1, arrival=2))
    views = s.request_views()
    assert [(v.request_id, v.phase) for v in views] == [
        ("high", RequestPhase.WAITING),
        ("normal", RequestPhase.WAITING),
        ("run", RequestPhase.RUNNING),
    ]
    assert views[0].demand_blocks == 3 and views[1].demand_blocks == 2  # (8 + 1) / 4, (7 + 1) / 4
    assert views[2].physical_blocks == 3 and views[2].num_tokens == 13


def test_load_aggregates_agree_with_views() -> None:
    s = make(max_num_batched_tokens=40, queue_policy="priority")
    for i in range(8):
        s.add_request(req(f"r{i}", prompt=9 + i, output=6, priority=-(i % 2), arrival=i))
    for _ in range(3):
        step(s)
    load, views = s.load(), s.request_views()
    # (the counts leave the running requests' outputs out: the simulator's admission reads its engines)
    assert load == dataclasses.replace(aggregate_views(views), running_output_tokens=[])
    waiting = [v for v in views if v.phase is RequestPhase.WAITING]
    running = [v for v in views if v.phase is RequestPhase.RUNNING]
    assert load.num_waiting == len(waiting) and load.num_running == len(running)
    assert load.waiting_demand_blocks == sum(v.demand_blocks for v in waiting)
    assert load.head_demand_blocks == (waiting[0].demand_blocks if waiting else 0)
    for level in load.by_priority:
        assert level.running_blocks == sum(v.physical_blocks for v in running if v.priority == level.priority)
        assert level.num_waiting == sum(1 for v in waiting if v.priority == level.priority)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
@pytest.mark.parametrize("mode", ["v1", "v0"])
def test_random_operations_keep_invariants_and_complete_every_request(policy: str, mode: str) -> None:
    rng = random.Random(f"{policy}{mode}")
    s = make(num_blocks=24, max_num_batched_tokens=48, queue_policy=policy, step_mode=mode, max_model_len=96)
    expected: dict[str, SimRequest] = {}
    aborted: set[str] = set()
    for i in range(400):
        if rng.random() < 0.3:
            rid = f"r{i}"
            expected[rid] = req(rid, rng.randint(1, 60), rng.randint(1, 40), priority=rng.choice((0, -1)), arrival=i)
            s.add_request(expected[rid])
        if rng.random() < 0.03 and s.requests:
            rid = rng.choice(sorted(s.requests))
            s.abort_request(rid)
            aborted.add(rid)
        if rng.random() < 0.05 and s.running:
            victim = rng.choice(s.running).request_id
            s.suspend(victim)
            if rng.random() < 0.5:
                s.resume(victim)
        elif s.suspended and rng.random() < 0.2:
            s.resume(next(iter(s.suspended)))
        step(s, now=i)
    for rid in list(s.suspended):
        s.resume(rid)
    run_until_idle(s)
    assert s.num_preemptions_total > 0
    for rid, r in expected.items():
        if rid not in aborted:
            assert r.num_output_tokens == r.stop_at_output, rid
            assert r.stop_at_output == min(r.max_tokens, 96 - r.prompt_len)
    assert s.block_manager.num_free == 24 and not s.requests
