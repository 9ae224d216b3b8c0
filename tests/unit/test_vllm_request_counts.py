"""The vLLM adapter's per-request counts that outlive one vLLM request (no vLLM needed): a
migrated or re-added request's preemptions go on from the count it came with, and its commit
carries the last step's logprobs only when that step ended the output."""

from __future__ import annotations

from types import SimpleNamespace

from services.llumlet.engines.vllm.driver import VllmDriver
from services.llumlet.engines.vllm.migration import VllmMigration
from services.llumlet.engines.vllm.state import SharedState, Suspended, Tracked, TrackedStatus
from shared.messages import GenerateRequest, SamplingParams, TokenLogprob


def step_output(tracked: Tracked, token_ids: list[int]):
    completion = SimpleNamespace(token_ids=token_ids, finish_reason=None, logprobs=None)
    return VllmDriver._to_step_output(tracked, SimpleNamespace(outputs=[completion], finished=False,
                                                               num_cached_tokens=0))


def test_a_migrated_request_s_preemptions_go_on_from_the_commit_s_count():
    request = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=20), "gw.out")
    tracked = Tracked("r1", 0, 3, request=request, num_delivered=5, prior_preemptions=2)
    tracked.vllm_request = SimpleNamespace(num_preemptions=1)
    assert step_output(tracked, [9]).num_preemptions == 3


def test_the_commit_counts_every_preemption_and_carries_the_last_step_s_logprobs():
    request = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=20, logprobs=1), "gw.out")
    shared = SharedState()
    tracked = Tracked("r1", 0, 3, request=request, prior_preemptions=2)
    tracked.move(TrackedStatus.IN_VLLM)
    tail = [TokenLogprob(-0.5, [(7, -0.5)])]
    tracked.move(TrackedStatus.SUSPENDED, Suspended("r1-x", (0, 1), 8, 1, (4, 5, 6, 7, 8), tail_logprobs=tail))
    shared.requests["r1"] = tracked
    migration = VllmMigration(SimpleNamespace(shared=shared))
    commit = migration.migration_commit("r1", "m1")
    assert commit.num_preemptions == 3
    assert commit.tail_logprobs == tail and commit.output_token_ids == [4, 5, 6, 7, 8]


def test_only_a_last_step_that_ends_the_output_is_a_tail():
    from services.llumlet.engines.vllm.driver import _tail_logprobs

    tracked = Tracked("r1", 0, 3)
    assert _tail_logprobs(tracked, 4) is None  # the request asked for none
    step = [TokenLogprob(-1.0), TokenLogprob(-2.0)]
    tracked.last_logprobs = (2, step)
    assert _tail_logprobs(tracked, 4) == step
    assert _tail_logprobs(tracked, 5) is None  # a later step had none: these are not the last tokens
