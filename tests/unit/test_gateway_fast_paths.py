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


def test_fast_decode_matches_transformers_decode(byte_level):
    tokenizer = ModelTokenizer(byte_level, byte_level, max_model_len=64)
    assert tokenizer._fast_decode is not None, "the tiny model's tokenizer should take the fast path"
    rng = random.Random(0)
    specials = byte_level.all_special_ids
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(byte_level))
               for _ in range(rng.randrange(0, 12))]
        assert tokenizer.decode(ids) == byte_level.decode(ids, skip_special_tokens=True), ids
    tokenizer.close()


def test_tokenizer_that_cleans_up_spaces_keeps_the_general_decode(byte_level):
    from transformers import PreTrainedTokenizerFast

    cleaning = PreTrainedTokenizerFast(tokenizer_object=byte_level.backend_tokenizer, clean_up_tokenization_spaces=True)
    tokenizer = ModelTokenizer(cleaning, cleaning, max_model_len=64)
    assert tokenizer._fast_decode is None
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
