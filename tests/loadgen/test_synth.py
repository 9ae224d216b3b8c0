"""Prompt synthesis: exact token counts with a real (tiny, trained-in-test) tokenizer, and
Mooncake hash_ids turned into prefixes that really are shared token for token."""

from __future__ import annotations

import pytest

from loadgen.datasets import load_dataset
from loadgen.records import RequestSpec
from loadgen.schedule import SchedulePlan, build_schedule
from loadgen.synth import PromptSynthesizer, word_pool

from .conftest import trace_path


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_pool_words_are_single_tokens(tokenizer) -> None:
    pool = word_pool(tokenizer)
    assert len(pool) >= 8
    for word in pool:
        assert len(_ids(tokenizer, word)) == 1 and len(_ids(tokenizer, " " + word)) == 1


@pytest.mark.parametrize("length", [1, 2, 3, 7, 64, 511, 512, 513, 1500])
def test_synthesized_prompt_has_the_exact_token_count(any_tokenizer, length: int) -> None:
    synthesizer = PromptSynthesizer(any_tokenizer, seed=0)
    text, count = synthesizer.prompt_for(RequestSpec(length, 4), key=length)
    assert count == length
    assert len(_ids(any_tokenizer, text)) == length


def test_prompts_are_deterministic_in_seed_and_key(tokenizer) -> None:
    spec = RequestSpec(40, 4)
    first = PromptSynthesizer(tokenizer, seed=1).prompt_for(spec, key=3)
    assert first == PromptSynthesizer(tokenizer, seed=1).prompt_for(spec, key=3)
    assert first != PromptSynthesizer(tokenizer, seed=2).prompt_for(spec, key=3)
    assert first != PromptSynthesizer(tokenizer, seed=1).prompt_for(spec, key=4)


def test_dataset_text_is_sent_unchanged(tokenizer) -> None:
    text, count = PromptSynthesizer(tokenizer).prompt_for(RequestSpec(99, 4, prompt="the lazy dog"), key=0)
    assert text == "the lazy dog" and count == len(_ids(tokenizer, "the lazy dog"))


def test_shared_hash_ids_share_the_token_prefix(any_tokenizer) -> None:
    tokenizer = any_tokenizer
    synthesizer = PromptSynthesizer(tokenizer, seed=0)
    first, _ = synthesizer.prompt_for(RequestSpec(1300, 4, hash_ids=(0, 1, 2)), key=0)
    second, _ = synthesizer.prompt_for(RequestSpec(1100, 4, hash_ids=(0, 1, 7)), key=1)
    other, _ = synthesizer.prompt_for(RequestSpec(1100, 4, hash_ids=(9, 1, 7)), key=2)
    first_ids, second_ids, other_ids = (_ids(tokenizer, t) for t in (first, second, other))
    assert (len(first_ids), len(second_ids)) == (1300, 1100)
    assert first_ids[:1024] == second_ids[:1024]
    assert first_ids[1024:1100] != second_ids[1024:1100]
    assert other_ids[:512] != first_ids[:512]
    assert other_ids[512:1024] == first_ids[512:1024]  # same block id, same block of tokens


def test_mooncake_fixture_prefixes_are_shared(tokenizer) -> None:
    records = load_dataset(f"mooncake:{trace_path('mooncake_synthetic_first400.jsonl')}", num_requests=59)
    a, b = records[15], records[58]  # the fixture's requests 15 and 58 share 5 leading blocks
    shared = next(i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)) if x != y)
    assert shared == 5
    synthesizer = PromptSynthesizer(tokenizer, seed=0)
    ids_a, ids_b = (_ids(tokenizer, synthesizer.prompt_for(r, key=k)[0]) for r, k in ((a, 15), (b, 58)))
    assert (len(ids_a), len(ids_b)) == (a.input_len, b.input_len)
    assert ids_a[: shared * 512] == ids_b[: shared * 512]


def test_token_id_prompts_have_the_exact_length(tokenizer) -> None:
    specs = load_dataset("random:37:5", num_requests=3)
    plan = SchedulePlan(send_token_ids=True)
    scheduled = build_schedule(specs, plan, PromptSynthesizer(tokenizer))
    for request in scheduled:
        assert isinstance(request.prompt, list) and len(request.prompt) == 37 == request.input_len
