"""Prompt text synthesized to an exact token count with the target model's tokenizer.

Prompts are words joined by spaces, drawn from a pool of vocabulary words that are one token
both alone and after a space, so that n words are n tokens for byte-level BPE and SentencePiece
tokenizers alike; every prompt is then re-tokenized and its tail fixed up until the count is
exact (or a clear error is raised). Mooncake `hash_ids` map to deterministic 512-word blocks, so
requests that share leading hash ids share that prefix text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.datasets import PREFIX_BLOCK_TOKENS
from loadgen.errors import LoadgenError
from loadgen.records import RequestSpec

_WORD = re.compile(r"^[A-Za-z]+$")
_MIN_POOL = 8
_MAX_POOL = 4096
_MAX_FIXUPS = 64
_MAX_TAIL_TRIES = 256


def load_tokenizer(path: str | Path) -> Any:
    """A local Hugging Face tokenizer directory, loaded offline."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise LoadgenError(f"tokenizer {path} is not a local directory (nothing is downloaded)")
    from transformers import AutoTokenizer  # heavy import: only when a tokenizer is needed

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoadgenError(f"cannot load tokenizer from {path}: {exc}") from None


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def word_pool(tokenizer: Any) -> list[str]:
    """Vocabulary words that are a single token both alone and preceded by a space."""
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])  # BPE: common first
    words = (_plain_word(token) for token, _ in by_id)
    candidates = list(dict.fromkeys(w for w in words if w))[: _MAX_POOL * 4]
    if not candidates:
        raise LoadgenError("the tokenizer's vocabulary has no plain words to build prompts from")
    alone = tokenizer(candidates, add_special_tokens=False)["input_ids"]
    spaced = tokenizer([" " + w for w in candidates], add_special_tokens=False)["input_ids"]
    both = [w for w, a, s in zip(candidates, alone, spaced) if len(a) == 1 and len(s) == 1]
    if len(both) >= _MIN_POOL:
        return both[:_MAX_POOL]
    # Fewer clean words: the fix-up loop still makes lengths exact, it just works harder.
    either = [w for w, a, s in zip(candidates, alone, spaced) if len(a) == 1 or len(s) == 1]
    return (either or candidates)[:_MAX_POOL]


def _plain_word(token: str) -> str | None:
    """'Ġthe' / '▁the' / 'the' → 'the'; None for anything but ASCII letters."""
    word = token.lstrip("Ġ▁ ")
    return word if _WORD.match(word) else None


class PromptSynthesizer:
    """Builds exact-length prompts; deterministic in (seed, key) and in (seed, hash id)."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self.pool = word_pool(tokenizer)
        self._blocks: dict[int, list[str]] = {}

    def count(self, text: str) -> int:
        return count_tokens(self.tokenizer, text)

    def prompt_for(self, spec: RequestSpec, key: int) -> tuple[str, int]:
        """(prompt text, its token count). Dataset text is kept as is; otherwise synthesized."""
        if spec.prompt is not None:
            return spec.prompt, self.count(spec.prompt)
        if spec.input_len < 1:
            raise LoadgenError(f"request {key}: a prompt needs at least 1 token")
        prefix, prefix_tokens = self._prefix_words(spec)
        tail_rng = self._tail_rng(spec, key)
        tail_tokens = spec.input_len - prefix_tokens
        tail = self._fit(self._draw(tail_rng, tail_tokens), tail_tokens, tail_rng, key)
        words = self._fit(prefix + tail, spec.input_len, tail_rng, key, protected=len(prefix))
        return " ".join(words), spec.input_len

    def _prefix_words(self, spec: RequestSpec) -> tuple[list[str], int]:
        """The words of the request's full hash-id blocks (each block alone is 512 tokens)."""
        full_blocks = min(spec.input_len // PREFIX_BLOCK_TOKENS, len(spec.hash_ids))
        words = [word for hash_id in spec.hash_ids[:full_blocks] for word in self._block(hash_id)]
        return words, full_blocks * PREFIX_BLOCK_TOKENS

    def _tail_rng(self, spec: RequestSpec, key: int) -> np.random.Generator:
        """A partial last block is seeded by its hash id (a later request may share it too)."""
        partial = spec.input_len // PREFIX_BLOCK_TOKENS
        if partial < len(spec.hash_ids):
            return np.random.default_rng([self.seed, 1, spec.hash_ids[partial]])
        return np.random.default_rng([self.seed, 2, key])

    def _block(self, hash_id: int) -> list[str]:
        if hash_id not in self._blocks:
            rng = np.random.default_rng([self.seed, 1, hash_id])
            words = self._draw(rng, PREFIX_BLOCK_TOKENS)
            self._blocks[hash_id] = self._fit(words, PREFIX_BLOCK_TOKENS, rng, f"block {hash_id}")
        return self._blocks[hash_id]

    def _draw(self, rng: np.random.Generator, n: int) -> list[str]:
        return [self.pool[i] for i in rng.integers(0, len(self.pool), size=max(n, 0))]

    def _fit(
        self, words: list[str], target: int, rng: np.random.Generator, key: object, protected: int = 0
    ) -> list[str]:
        """Grow or cut the words after `protected` until the text is `target` tokens.

        A target of 0 (an empty tail) is met by no words. Steps are scaled by tokens per word,
        so tokenizers that merge across spaces converge too.
        """
        if target <= 0:
            return []
        seen: set[tuple[int, int]] = set()
        for _ in range(_MAX_FIXUPS):
            count = self.count(" ".join(words))
            if count == target:
                return words
            if (len(words), count) in seen or (count > target and len(words) == 1):
                break  # a word is worth more than one token here: try other endings
            seen.add((len(words), count))
            per_word = max(count / max(len(words), 1), 1.0)
            step = max(int(abs(target - count) / per_word), 1)
            if count < target:
                words = words + self._draw(rng, step)
            else:
                floor = protected if len(words) > protected + 1 else 1  # the tail goes first
                words = words[: max(len(words) - step, floor, 1)]
        return self._fit_tail(words, target, rng, key)

    def _fit_tail(self, words: list[str], target: int, rng: np.random.Generator, key: object) -> list[str]:
        """A short random walk over the last word(s): for tokenizers whose words merge oddly."""
        for _ in range(_MAX_TAIL_TRIES):
            words = words[:-1] + self._draw(rng, 1)
            count = self.count(" ".join(words))
            if count == target:
                return words
            if count < target:
                words.append(self.pool[0])
            elif len(words) > 1 and count - target > 1:
                words.pop()
        raise LoadgenError(
            f"request {key}: cannot synthesize a prompt of exactly {target} tokens with this tokenizer"
        )
