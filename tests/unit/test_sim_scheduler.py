from __future__ import annotations

import random

import pytest

from shared.engine_model.views import EngineError, RequestPhase
from shared.engine_model.request import RequestStatus, SimRequest
from shared.engine_model.config import SchedulerConfig
from shared.engine_model.load_report import aggregate_views
from shared.engine_model.scheduler import SimScheduler
from shared.engine_model.step import SchedulerOutput
from shared.messages import FinishReason


def make(**overrides) -> SimScheduler:
    config = dict(num_blocks=64, block_size=4, max_model_len=256, max_num_batched_tokens=100, max_num_seqs=16)
    config.update(overrides)
    return SimScheduler(SchedulerConfig(**config))


def req(
    rid: str, prompt: int, output: int, *, priority: int = 0, arrival: float = 0.0, target: int | None = None
) -> SimRequest:
    return SimRequest(rid, prompt, output, target_output_len=target, priority=priority, arrival_time=arrival)


def step(s: SimScheduler, now: float = 0.0) -> tuple[SchedulerOutput, list[str], list[str]]:
    out = s.schedule(now)
    events = s.update_from_output(out, now + 0.01)
    s.check_invariants()
    return out, [r.request_id for r in events.new_token], [r.request_id for r in events.finished]


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_new_tokens)}


def run_until_idle(s: SimScheduler, max_steps: int = 10_000) -> dict[str, int]:
    """Steps until no work is left; returns the number of tokens each request produced."""
    produced: dict[str, int] = {}
    for i in range(max_steps):
        if not s.has_work():
            return produced
        _, new, _ = step(s, now=i * 0.01)
        for rid in new:
            produced[rid] = produced.get(rid, 0) + 1
    raise AssertionError("scheduler did not drain")


# -- v1: continuous batching and chunked prefill ----------------------------------------------


def test_v1_admits_waiting_requests_up_to_the_token_budget() -> None:
    s = make()
    for i in range(5):
        s.add_request(req(f"r{i}", prompt=30, output=4))
    out, new, _ = step(s)
    assert scheduled(out) == {"r0": 30, "r1": 30, "r2": 30, "r3": 10}  # last one chunked
    assert out.num_scheduled_tokens == 100
    assert new == ["r0", "r1", "r2"]  # a partial prefill samples nothing
    assert len(s.waiting) == 1 and len(s.running) == 4


def test_v1_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    s = make(max_num_batched_tokens=40)
    s.add_request(req("long", prompt=100, output=3))
    chunks = []
    for _ in range(3):
        out, new, _ = step(s)
        chunks.append((scheduled(out)["long"], new))
    assert chunks == [(40, []), (40, []), (20, ["long"])]
    assert s.get("long").num_computed_tokens == 100


def test_v1_running_requests_decode_before_waiting_ones_are_admitted() -> None:
    s = make(max_num_batched_tokens=50)
    s.add_request(req("a", prompt=40, output=10))
    s.add_request(req("b", prompt=40, output=10))
    step(s)  # a: 40 tokens, b: 10-token chunk
    out, _, _ = step(s)
    assert scheduled(out) == {"a": 1, "b": 30}
    assert out.decode_batch_size == 1 and out.decode_context_tokens == 41
    assert out.prefill_tokens == 30 and out.prefill_chunks == [(30, 10)]


def test_v1_without_chunking_waits_for_room_for_the_whole_prompt() -> None:
    s = make(max_num_batched_tokens=50, max_model_len=50, enable_chunked_prefill=False)
    s.add_request(req("a", prompt=30, output=5))
    s.add_request(req("b", prompt=30, output=5))
    out, _, _ = step(s)
    assert scheduled(out) == {"a": 30}
    out, _, _ = step(s)
    assert scheduled(out) == {"a": 1, "b": 30}
    with pytest.raises(ValueError, match="chunked"):
        make(max_num_batched_tokens=50, max_model_len=51, enable_chunked_prefill=False)



def test_v1_admits_a_chunked_prompt_only_when_the_whole_sequence_fits() -> None:
    # 16 blocks of 4 tokens; "a" holds 6. "long" (44 tokens = 11 blocks) has a 20-token first
    # chunk that fits the 10 free blocks, but its whole prompt does not (as vLLM's
    # scheduler_reserve_full_isl): it waits until "a" has finished.
    s = make(num_blocks=16, max_num_batched_tokens=21)
    s.add_request(req("a", prompt=20, output=4))
    step(s)
    s.add_request(long := req("long", prompt=44, output=2))
    out, _, _ = step(s)
    assert scheduled(out) == {"a": 1} and long.status == RequestStatus.WAITING
    run_until_idle(s)
    assert long.num_preemptions == 0 and long.num_output_tokens == 2


def test_v1_chunk_only_admission_is_available_for_comparison() -> None:
    s = make(num_blocks=16, max_num_batched_tokens=21, reserve_full_sequence=False)
    s.add_request(req("a", prompt=20, output=4))
    step(s)
    s.add_request(req("long", prompt=44, output=2))
    out, _, _ = step(s)
    assert scheduled(out) == {"a": 1, "long": 20}

def test_max_num_seqs_caps_the_batch() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", prompt=5, output=3))
    out, _, _ = step(s)
    assert len(out.requests) == 2 and len(s.waiting) == 2


def test_requests_finish_with_exactly_max_tokens() -> None:
    s = make()
    for i in range(10):
        s.add_request(req(f"r{i}", prompt=7 + i, output=5 + i))
    produced = run_until_idle(s)
    assert produced == {f"r{i}": 5 + i for i in range(10)}
    assert s.block_manager.num_free == 64


def test_target_output_len_stops_early_with_stop_reason() -> None:
    s = make()
    s.add_request(r_stop := req("stop", prompt=5, output=20, target=3))
    s.add_request(r_len := req("len", prompt=5, output=3, target=10))
    run_until_idle(s)
    assert r_stop.num_output_tokens == 3 and r_stop.finish_reason is FinishReason.STOP
    assert r_len.num_output_tokens == 3 and r_len.finish_reason is FinishReason.LENGTH


def test_generation_stops_at_max_model_len() -> None:
    s = make(max_model_len=40)
    s.add_request(r := req("r", prompt=30, output=50))
    run_until_idle(s)
    assert r.num_output_tokens == 10 and r.finish_reason is FinishReason.LENGTH


# -- rejection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "overrides"),
    [(256, {}), (300, {}), (64 * 4, {"max_model_len": 10_000}), (0, {})],
    ids=["over-max-model-len", "way-over", "over-kv-capacity", "empty"],
)
def test_impossible_requests_are_rejected_at_add(prompt: int, overrides: dict) -> None:
    s = make(**overrides)
    with pytest.raises(EngineError):
        s.add_request(req("r", prompt=prompt, output=4))
    assert not s.has_work() and s.get("r") is None


def test_longest_possible_prompt_is_accepted() -> None:
    s = make(max_model_len=10_000, max_num_batched_tokens=1000)
    s.add_request(r := req("r", prompt=64 * 4 - 1, output=4))
    run_until_idle(s)
    assert r.num_output_tokens == 1 and r.finish_reason is FinishReason.LENGTH  # KV is full


def test_duplicate_ids_and_bad_lengths_are_rejected() -> None:
    s = make()
    s.add_request(req("r", prompt=4, output=4))
    with pytest.raises(EngineError, match="duplicate"):
        s.add_request(req("r", prompt=4, output=4))
    with pytest.raises(EngineError):
        s.add_request(req("zero", prompt=4, output=0))


# -- preemption --------------------------------------------------------------------------------


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


# -- v0 step mode ------------------------------------------------------------------------------


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


# -- abort -------------------------------------------------------------------------------------


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


# -- migration hooks ---------------------------------------------------------------------------


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


# -- load views --------------------------------------------------------------------------------


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
    assert load == aggregate_views(views)
    waiting = [v for v in views if v.phase is RequestPhase.WAITING]
    running = [v for v in views if v.phase is RequestPhase.RUNNING]
    assert load.num_waiting == len(waiting) and load.num_running == len(running)
    assert load.waiting_demand_blocks == sum(v.demand_blocks for v in waiting)
    assert load.head_demand_blocks == (waiting[0].demand_blocks if waiting else 0)
    for level in load.by_priority:
        assert level.running_blocks == sum(v.physical_blocks for v in running if v.priority == level.priority)
        assert level.num_waiting == sum(1 for v in waiting if v.priority == level.priority)


# -- randomized --------------------------------------------------------------------------------


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
