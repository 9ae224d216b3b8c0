"""The destination's catch-up chunks (services/llumlet/migration_hooks.py) and the commit's
last-step logprobs on the wire: bounded, no NaN, -inf kept."""

from __future__ import annotations

import math

import pytest

from services.gateway.streams import OutputStream
from services.llumlet.migration_hooks import catch_up_chunks
from shared.messages import (
    MAX_TAIL_LOGPROBS,
    GenerateRequest,
    MigrationCommit,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
    WireError,
    decode,
    encode,
)


def commit_of(outputs: list[int], tail: list[TokenLogprob] | None, resume_from: int = 0) -> MigrationCommit:
    request = GenerateRequest("r1", [5, 6, 7, *outputs[:resume_from]], SamplingParams(max_tokens=50, logprobs=1),
                              "gw.out", resume_from=resume_from)
    return MigrationCommit("m1", request, outputs, num_computed_tokens=3, num_preemptions=2, tail_logprobs=tail,
                           source_instance_id="src")


def lp(value: float) -> TokenLogprob:
    return TokenLogprob(value, [(1, value)])


def test_the_last_step_goes_in_a_chunk_of_its_own_with_its_logprobs():
    head, tail = catch_up_chunks("dst", commit_of([10, 11, 12, 13], [lp(-0.5)]))
    assert (head.start_index, head.token_ids, head.logprobs) == (0, [10, 11, 12], None)
    assert (tail.start_index, tail.token_ids, tail.logprobs) == (3, [13], [lp(-0.5)])
    assert head.handover and tail.handover and head.num_preemptions == tail.num_preemptions == 2
    assert head.handover_from == tail.handover_from == "src"  # (a gateway that left `src` drops this copy)
    assert head.num_prompt_tokens == tail.num_prompt_tokens == 3


def test_without_logprobs_one_chunk_repeats_the_output_and_an_empty_output_still_hands_over():
    (only,) = catch_up_chunks("dst", commit_of([10, 11], None))
    assert (only.start_index, only.token_ids, only.logprobs, only.handover) == (0, [10, 11], None, True)
    (empty,) = catch_up_chunks("dst", commit_of([], None))
    assert empty.token_ids == [] and empty.handover


def test_a_tail_covering_the_whole_output_and_a_resumed_request_s_offset():
    (only,) = catch_up_chunks("dst", commit_of([10, 11], [lp(-1.0), lp(-2.0)]))
    assert (only.start_index, only.logprobs) == (0, [lp(-1.0), lp(-2.0)])
    # Resumed by recompute after 2 tokens: indices continue from there, the prompt is the client's.
    head, tail = catch_up_chunks("dst", commit_of([10, 11, 12], [lp(-1.0)], resume_from=2))
    assert (head.start_index, tail.start_index, tail.num_prompt_tokens) == (2, 4, 3)


def test_a_client_that_read_the_catch_up_before_the_source_s_late_chunk_has_every_logprob():
    stream = OutputStream("r1", "src")
    stream.feed(TokenChunk("r1", "src", 0, [10, 11], logprobs=[lp(-0.1), lp(-0.2)]))
    for chunk in catch_up_chunks("dst", commit_of([10, 11, 12], [lp(-0.3)])):
        stream.feed(chunk)
    deliveries = [stream._queue.get_nowait() for _ in range(stream._queue.qsize())]
    stream.feed(TokenChunk("r1", "src", 2, [12], logprobs=[lp(-0.3)]))  # late: nothing new, dropped
    assert [t for d in deliveries for t in d.token_ids] == [10, 11, 12]
    assert [x for d in deliveries for x in d.logprobs] == [lp(-0.1), lp(-0.2), lp(-0.3)]
    assert stream._queue.empty() and stream.holder == "dst"


def test_the_commit_s_tail_is_bounded_and_no_longer_than_the_output():
    commit = commit_of([1] * (MAX_TAIL_LOGPROBS + 1), [lp(-1.0)] * (MAX_TAIL_LOGPROBS + 1))
    with pytest.raises(WireError, match="tail_logprobs"):
        decode(encode(commit), MigrationCommit)
    bad = commit_of([1, 2], [lp(-1.0)])
    bad.tail_logprobs = [lp(-1.0)] * 3  # (constructed whole, it would be refused at once)
    with pytest.raises(WireError, match="3 tail logprobs for 2 output tokens"):
        decode(encode(bad), MigrationCommit)
    with pytest.raises(ValueError):
        commit_of([1], [lp(-1.0), lp(-2.0)])


def test_minus_infinity_travels_and_nan_is_refused():
    commit = decode(encode(commit_of([1, 2], [TokenLogprob(-math.inf, [(3, -math.inf)])])), MigrationCommit)
    assert commit.tail_logprobs[0].logprob == -math.inf and commit.tail_logprobs[0].top == [(3, -math.inf)]
    nan_chunk = TokenChunk("r1", "a", 0, [1], logprobs=[lp(-1.0)])
    nan_chunk.logprobs[0].logprob = math.nan
    with pytest.raises(WireError, match="NaN"):
        decode(encode(nan_chunk), TokenChunk)
    nan_top = TokenChunk("r1", "a", 0, [1], logprobs=[lp(-1.0)])
    nan_top.logprobs[0].top = [(1, math.nan)]
    with pytest.raises(WireError, match="NaN"):
        decode(encode(nan_top), TokenChunk)


def test_minus_infinity_reaches_the_client_as_vllm_s_floor_in_valid_json():
    import json

    from services.gateway.logprobs import MIN_LOGPROB, LogprobsFormatter
    from services.gateway.responses import json_bytes

    def strict(constant: str):  # JSON has no -Infinity or NaN (Python's parser would take them)
        raise AssertionError(f"{constant} in the JSON")

    formatter = LogprobsFormatter(lambda token_id: f"t{token_id}")
    tokens = [(3, TokenLogprob(-math.inf, [(3, -math.inf), (4, -math.inf)])), (5, None)]
    chat = json.loads(json_bytes(formatter.chat(tokens)), parse_constant=strict)
    assert chat["content"][0]["logprob"] == MIN_LOGPROB == -9999.0
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [MIN_LOGPROB, MIN_LOGPROB]
    assert chat["content"][1]["logprob"] is None and chat["content"][1]["top_logprobs"] == []
    completion = json.loads(json_bytes(formatter.completion(tokens, 0)), parse_constant=strict)
    assert completion["token_logprobs"] == [MIN_LOGPROB, None]
    assert completion["top_logprobs"] == [{"t3": MIN_LOGPROB, "t4": MIN_LOGPROB}, None]
