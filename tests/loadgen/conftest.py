"""Fixtures for the loadgen tests: the trace handouts and a tiny tokenizer trained in the test."""

from __future__ import annotations

from pathlib import Path

import pytest

TRACES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"

_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a serving system schedules requests across many instances of a model",
    "live migration moves a running request from one instance to another",
    "the scheduler dispatches each new request to the freest instance",
    "tokens are generated one at a time while the cache grows block by block",
    "short prompts and long prompts compete for the same memory",
    "priority requests run earlier than normal requests when memory is tight",
    "every instance reports its load to the global scheduler each interval",
] * 4


def trace_path(name: str) -> Path:
    path = TRACES_DIR / name
    if not path.is_file():
        pytest.skip(f"trace fixture {path} is absent (the ../shared handouts are not checked out)")
    return path


def _train_tokenizer(directory: Path, style: str) -> Path:
    """A BPE tokenizer trained on a few sentences, saved as a Hugging Face tokenizer directory.

    Styles: "bytelevel" (GPT-2/Llama-3/Qwen-like), "merging" (byte-level without splitting on
    spaces, so merges cross word boundaries and words are not one token each: exercises the
    synthesizer's fix-up loop), "metaspace" (SentencePiece/Llama-2-like ▁ prefixes).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    if style == "metaspace":
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        alphabet: list[str] = []
    else:
        split = style == "bytelevel"
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split)
        core.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator(_SENTENCES, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    wrapped.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_tokenizer(tmp_path_factory.mktemp("tokenizer"), "bytelevel")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    from loadgen.synth import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session", params=["bytelevel", "merging", "metaspace"])
def any_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from loadgen.synth import load_tokenizer

    return load_tokenizer(_train_tokenizer(tmp_path_factory.mktemp(request.param), request.param))
