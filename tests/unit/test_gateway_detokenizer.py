"""Incremental detokenization (split UTF-8 characters, SentencePiece spaces) and stop strings."""

from __future__ import annotations

import pytest

from services.gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from services.gateway.stop_strings import StopStringMatcher


@pytest.fixture(scope="module")
def byte_level():
    """The tiny model's byte-level BPE: characters outside its corpus merges split into bytes."""
    from services.tools.make_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-style tokenizer: Metaspace words, byte fallback for unknown characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for word in ("▁hello", "▁world", "▁a"):
        for char in word:
            vocab.setdefault(char, len(vocab))
        for end in range(2, len(word) + 1):
            merges.append((word[:end - 1], word[end - 1]))
            vocab.setdefault(word[:end], len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream_text(tokenizer, text: str, prompt: str = "Say:", per_push: int = 1) -> list[str]:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t, skip_special_tokens=True), prompt_ids)
    pieces = [detok.push(ids[i:i + per_push]) for i in range(0, len(ids), per_push)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", ["Emoji: 😀 🚀 🦊!", "中文字符：敏捷的狐狸", "mixed ❤️ Привет 👍🏽 end"])
def test_split_multibyte_characters_come_out_whole(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in byte_level.decode([i]) for i in ids), "the test needs a character split across tokens"
    pieces = stream_text(byte_level, text)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_pushing_several_tokens_at_once_gives_the_same_text(byte_level):
    text = "Große 😀 models, 大型语言模型"
    assert "".join(stream_text(byte_level, text, per_push=3)) == text


def test_sentencepiece_word_boundaries_keep_their_spaces(sentencepiece_like):
    pieces = stream_text(sentencepiece_like, "hello world a", prompt="hello")
    assert pieces[:3] == [" hello", " world", " a"]


def test_sentencepiece_byte_fallback_characters_come_out_whole(sentencepiece_like):
    text = "hello 世界 world"
    pieces = stream_text(sentencepiece_like, text, prompt="a")
    assert "".join(pieces) == " " + text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_flush_releases_an_incomplete_character(byte_level):
    emoji_bytes = byte_level.encode("😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level.decode, [])
    assert detok.push(emoji_bytes[:-1]) == ""
    assert detok.flush() == byte_level.decode(emoji_bytes[:-1])
    assert detok.num_output_tokens == len(emoji_bytes) - 1


def test_stop_string_inside_one_delta_truncates_the_text():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.append("hello STOP world") == "hello "
    assert matcher.stopped and matcher.text == "hello "


def test_stop_string_split_across_deltas_is_never_partly_sent():
    matcher = StopStringMatcher(["STOP"])
    sent = [matcher.append(d) for d in ("hel", "lo ST", "O", "P and more")]
    assert "".join(sent) == "hello "
    assert matcher.stopped


def test_held_back_text_is_released_at_the_end():
    matcher = StopStringMatcher(["XYZ"])
    assert matcher.append("abcXY") == "abc"
    assert matcher.finish() == "XY"
    assert not matcher.stopped


def test_the_earliest_stop_string_wins():
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.append("hello world") == "hel"


def test_include_stop_str_in_output_keeps_the_stop_string():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert matcher.append("go STOP now") == "go STOP"


def test_without_stop_strings_text_passes_straight_through():
    matcher = StopStringMatcher([])
    assert matcher.append("abc") == "abc"
    assert matcher.finish() == ""
