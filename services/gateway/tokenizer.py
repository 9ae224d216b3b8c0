"""The model's own tokenizer and chat template, loaded from a local model directory."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from services.gateway.config import ConfigError
from services.gateway.errors import ApiError, bad_request
from shared.messages import Refusal

log = logging.getLogger(__name__)

# config.json keys that hold the context length, in the order transformers' configs use them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
# A normalizer may shorten text before it is split (NFC composes "e\u0301" into one character):
# the bound on characters per token allows for text twice as long as the tokens' own strings.
NORMALIZATION_MARGIN = 2


class PromptError(ValueError):
    """A prompt the tokenizer or chat template refuses (the client's fault: HTTP 400)."""


class ModelTokenizer:
    """Encoding runs on a pool of worker threads (long prompts would stall the event loop; one
    thread would queue every request behind the longest prompt), each on a tokenizer object of its
    own: a Rust tokenizer used from two threads at once can fail with "Already borrowed", and the
    event loop keeps decoding on the decoder meanwhile. The Rust encoder releases the GIL, so a
    long prompt costs the event loop little; `unfit_prompt_error` bounds how long a prompt can get here."""

    def __init__(self, decoder: Any, encoder: Any, max_model_len: int, workers: int = 1) -> None:
        assert workers >= 1
        self._decoder = decoder
        self.max_model_len = max_model_len
        self.vocab_size = len(decoder)
        self.has_chat_template = bool(getattr(encoder, "chat_template", None))
        self._fast_decode = _backend_decode(decoder)
        self._token_texts: dict[int, str] = {}
        self._chars_per_token = NORMALIZATION_MARGIN * _longest_token(decoder)
        self._encoder = encoder  # the template for each thread's copy
        self._spare_encoders = [encoder] + [copy.deepcopy(encoder) for _ in range(workers - 1)]
        self._local = threading.local()
        self._worker = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer",
                                          initializer=self._take_encoder)

    @classmethod
    def load(cls, model_dir: str, max_model_len: int | None = None, workers: int = 1) -> ModelTokenizer:
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory {model_dir!r} does not exist")
        limit = max_model_len or _context_length(path)
        if limit is None:
            raise ConfigError(f"{model_dir!r} has no context length in config.json: pass --max-model-len")
        return cls(_load_hf_tokenizer(path), _load_hf_tokenizer(path), limit, workers)

    @property
    def chars_per_token(self) -> int:
        """The most characters one token may stand for: no token of this vocabulary stands for
        more than its own string (times NORMALIZATION_MARGIN), so a text of c characters has at
        least ceil(c / chars_per_token) tokens, known before it is tokenized."""
        return self._chars_per_token

    def _take_encoder(self) -> None:
        """A pool thread's start: it gets an encoder of its own."""
        self._local.encoder = self._spare_encoders.pop()

    def _thread_encoder(self) -> Any:
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:  # a caller outside the pool (tests, tools): a copy for its thread
            encoder = self._local.encoder = copy.deepcopy(self._encoder)
        return encoder

    def close(self) -> None:
        self._worker.shutdown(wait=False)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.encode, text, add_special_tokens)

    async def apply_chat_template_async(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                                        continue_final_message: bool = False) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, self.apply_chat_template, messages, add_generation_prompt, continue_final_message)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw completion prompt: special tokens (BOS) added, as vLLM does."""
        _check_unicode(text, "the prompt")
        return list(self._thread_encoder().encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        if not self.has_chat_template:
            raise PromptError("the model has no chat template; use /v1/completions")
        for index, message in enumerate(messages):
            _check_unicode(message["content"], f"messages[{index}].content")
        try:
            ids = self._thread_encoder().apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    continue_final_message=continue_final_message, tokenize=True,
                                                    return_dict=False)
        except (TemplateError, ValueError) as exc:  # the messages broke the template (raise_exception)
            raise PromptError(f"chat template error: {exc}") from exc
        return list(ids)

    async def decode_async(self, token_ids: list[int]) -> str:
        """A whole list decoded on a pool thread, with the thread's own tokenizer (/detokenize: a
        client's list may be a million ids long). The Rust tokenizer's `decode_batch` releases
        the GIL, its `decode` does not: 200k ids held the event loop ~70 ms from a thread."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._decode_on_thread, token_ids)

    def _decode_on_thread(self, token_ids: list[int]) -> str:
        encoder = self._thread_encoder()
        if self._fast_decode is not None:  # (the same rule as `decode`'s: the same text)
            return str(encoder.backend_tokenizer.decode_batch([token_ids], skip_special_tokens=True)[0])
        return str(encoder.decode(token_ids, skip_special_tokens=True))

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's own string (vLLM's `return_token_strs`). Event loop only."""
        return list(self._decoder.convert_ids_to_tokens(token_ids))

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (a logprob entry's `token`). Event loop only."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decoder.decode([token_id], skip_special_tokens=False)
        return text

    def decode(self, token_ids: list[int]) -> str:
        """Event loop only. Twice per output token (incremental detokenization): straight to the
        Rust tokenizer when that gives the same text, which is ~3x cheaper than transformers' wrapper."""
        if self._fast_decode is not None:
            return self._fast_decode(token_ids, skip_special_tokens=True)
        return self._decoder.decode(token_ids, skip_special_tokens=True)


def unfit_prompt_error(prompt: str | None, messages: list[dict[str, str]] | None, chars_per_token: int,
                       limit: int, param: str) -> ApiError | None:
    """Before the tokenizer runs: the 400 in vLLM's words for a text prompt that cannot fit `limit`
    tokens whatever it says (the tokens it has at least, from its size), so that a 10 MB prompt
    costs a length check, not seconds of a tokenizer thread; None: it may fit. (Token ids:
    prepared.context_refusal counts them exactly.) Pure: body_parsing runs it in a worker process."""
    texts = [m["content"] for m in messages] if messages is not None else [prompt or ""]
    fewest = math.ceil(sum(len(text) for text in texts) / chars_per_token)
    if fewest < limit:  # (the rule of GatewayService.prepare: at least one token of room)
        return None
    room = ("which exceeds this limit even without any output tokens" if fewest > limit
            else "which leaves no room for output tokens")
    return bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                       f"at least {fewest} input tokens, {room}. Please reduce the length of the input prompt.",
                       param, Refusal.TOO_LONG)


def _check_unicode(text: str, what: str) -> None:
    """JSON may carry a lone surrogate ("\\ud800"), which is no Unicode text: the Rust tokenizer
    would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{what} is not valid Unicode: {exc.reason} at character {exc.start}") from None


def _longest_token(tokenizer: Any) -> int:
    """The most characters one token's string has (a byte-level BPE token's string has one
    character per byte; a byte-fallback token's, "<0xE2>", more): at least 1."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def _backend_decode(tokenizer: Any) -> Any:
    """The `tokenizers` decode behind a fast tokenizer whose own decode adds nothing to it (the
    generic fast-tokenizer decode, no clean-up of tokenization spaces); None otherwise."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    generic = cls.decode is PreTrainedTokenizerFast.decode and cls._decode is PreTrainedTokenizerFast._decode
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not generic or backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


def _load_hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer  # slow import: only when a gateway starts

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc


def _context_length(model_dir: Path) -> int | None:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {config_file}: {exc}") from exc
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None
