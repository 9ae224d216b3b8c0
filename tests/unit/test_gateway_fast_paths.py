"""Hot-path shortcuts in the gateway give exactly what the general path gives."""

from __future__ import annotations

import random

import pytest

from services.gateway.streams import Delivery, OutputStream
from services.gateway.tokenizer import ModelTokenizer
from shared.messages import TokenChunk


@pytest.fixture(scope="module")
def byte_level():
    from services.tools.make_model import build_tokenizer

    return build_tokenizer()


# Real payloads: prose with spaces before punctuation (what clean-up would change), code with
# indentation, accents, CJK and emoji (multi-byte characters cut across tokens).
PAYLOADS = [
    "Hello , world . It's fine ! Isn't it ?",
    "def f(x):\n    return x  # ok\n\n\tprint( f(1) )",
    "naïve café — 東京タワー 🚀🚀 ok",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def decodes_alike(tokenizer: ModelTokenizer, hf, ids: list[int]) -> None:
    """The gateway decodes a growing output twice per token (incremental detokenization): every
    prefix must decode as the tokenizer's own general decode does."""
    for end in range(len(ids) + 1):
        assert tokenizer.decode(ids[:end]) == hf.decode(ids[:end], skip_special_tokens=True), ids[:end]


def test_decode_matches_the_tokenizers_own_decode_on_real_payloads(byte_level):
    tokenizer = ModelTokenizer(byte_level, byte_level, max_model_len=64)
    specials = byte_level.all_special_ids
    for text in PAYLOADS:
        ids = byte_level.encode(text, add_special_tokens=False)
        decodes_alike(tokenizer, byte_level, ids)
        decodes_alike(tokenizer, byte_level, [specials[0], *ids[:5], specials[1], *ids[5:]])  # specials skipped
        assert tokenizer.decode(ids) == text  # byte-level, no clean-up: the text comes back as sent
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(byte_level))
               for _ in range(rng.randrange(0, 12))]
        assert tokenizer.decode(ids) == byte_level.decode(ids, skip_special_tokens=True), ids
    tokenizer.close()


def test_a_tokenizer_that_cleans_up_spaces_decodes_with_its_clean_up(byte_level):
    """Its own decode differs from the raw Rust decode (" ," → ","): the gateway must give the
    former, so it may not take the shortcut."""
    from transformers import PreTrainedTokenizerFast

    # (transformers skips the clean-up for BPE unless told: a WordPiece-style tokenizer would do it)
    cleaning = PreTrainedTokenizerFast(tokenizer_object=byte_level.backend_tokenizer, clean_up_tokenization_spaces=True,
                                       clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    tokenizer = ModelTokenizer(cleaning, cleaning, max_model_len=64)
    ids = cleaning.encode(PAYLOADS[0], add_special_tokens=False)
    assert cleaning.decode(ids) != cleaning.backend_tokenizer.decode(ids)  # the payload shows the difference
    for text in PAYLOADS:
        decodes_alike(tokenizer, cleaning, cleaning.encode(text, add_special_tokens=False))
    assert tokenizer.decode(ids) == "Hello, world. It's fine! Isn't it?"
    tokenizer.close()


async def test_next_takes_queued_deliveries_without_waiting():
    stream = OutputStream("r1")
    stream.feed(TokenChunk("r1", "a", 0, [1]))
    stream.feed(TokenChunk("r1", "a", 1, [2]))
    assert await stream.next(0.0001) == Delivery([1])
    assert await stream.next(0.0001) == Delivery([2])


async def test_next_still_times_out_on_silence():
    with pytest.raises(TimeoutError):
        await OutputStream("r1").next(0.01)
