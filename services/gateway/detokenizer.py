"""Incremental detokenization: token ids in, new text out, one request at a time.

Decoding token by token is wrong in two ways: a byte-level tokenizer splits a multi-byte UTF-8
character across tokens (each half decodes to U+FFFD), and SentencePiece tokenizers decide a
token's leading space from its left neighbour. So, as vLLM and TGI do, we decode a small window
of already-emitted tokens (the prefix) together with the new ones, and emit the text beyond the
prefix's own decoding only once it no longer ends in a replacement character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens that seed the window, so the first output token gets its leading space right.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: tokens before it are settled
        self._read_offset = len(self._ids)  # tokens before it have been emitted as text
        self._num_prompt_ids = len(self._ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_prompt_ids

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty while a character is split)."""
        self._ids.extend(token_ids)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """The text still held back at the end of the request (a character that never completed)."""
        prefix_text, new_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        settled = self._read_offset - self._prefix_offset
        return self._decode(window[:settled]), self._decode(window)
