"""The shared local scheduler (vLLM semantics): v1 continuous batching and chunked prefill, stop
conditions, rejection at add. (Preemption and v0: test_sim_scheduler_preemption.py; abort,
migration hooks, load views and the randomized run: test_sim_scheduler_lifecycle.py.)"""

from __future__ import annotations

import pytest

from shared.engine_model.views import EngineError
from shared.engine_model.request import RequestStatus
from shared.messages import FinishReason
from tests.unit.sim_scheduler_helpers import make, req, run_until_idle, scheduled, step


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
