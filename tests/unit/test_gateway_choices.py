"""A request's n choices: the prompt checked once, each choice a request of its own."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway.errors import ApiError
from services.gateway.prepared import another_choice, prepare_request
from services.gateway.protocol import GenerationOptions, RequestKind


def _first(prompt: list[int], options: GenerationOptions, response_id: str | None = None):
    return prepare_request(RequestKind.CHAT, prompt, options, 0, max_model_len=100, vocab_size=50,
                           default_max_tokens=None, response_id=response_id)


@pytest.mark.parametrize("response_id", [None, "chatcmpl-given"])
def test_another_choice_is_the_first_with_its_own_id_and_sampling(response_id):
    prompt = list(range(1, 40))
    options = GenerationOptions(n=3, seed=7, max_tokens=20)
    first = _first(prompt, options, response_id)
    second = another_choice(first, dataclasses.replace(options, seed=8), response_id)
    assert second.prompt_token_ids is first.prompt_token_ids  # not copied, not checked again
    assert second.request_id != first.request_id and second.request_id.startswith("chatcmpl-")
    assert second.response_id == (response_id or second.request_id)  # as prepare_request names it
    assert (second.options.seed, second.max_tokens, second.arrival) == (8, first.max_tokens, first.arrival)


def test_a_choice_with_another_budget_is_not_taken_for_the_same_request():
    first = _first([1, 2, 3], GenerationOptions(max_tokens=5))
    with pytest.raises(AssertionError):
        another_choice(first, GenerationOptions(max_tokens=6), None)


def test_the_first_choice_still_refuses_a_bad_prompt():
    with pytest.raises(ApiError) as refused:
        _first([1, 2, 99], GenerationOptions(n=2))
    assert refused.value.status == 400
