"""The model's own tokenizer and chat template, loaded from a local model directory."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from services.gateway.config import ConfigError

log = logging.getLogger(__name__)

# config.json keys that hold the context length, in the order transformers' configs use them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


class PromptError(ValueError):
    """A prompt the tokenizer or chat template refuses (the client's fault: HTTP 400)."""


class ModelTokenizer:
    """Encoding runs on a worker thread (long prompts would stall the event loop), on a tokenizer
    object of its own: a Rust tokenizer used from two threads at once can fail with "Already
    borrowed", and the event loop keeps decoding on the other one meanwhile."""

    def __init__(self, decoder: Any, encoder: Any, max_model_len: int) -> None:
        self._decoder = decoder
        self._encoder = encoder
        self.max_model_len = max_model_len
        self.vocab_size = len(decoder)
        self.has_chat_template = bool(getattr(encoder, "chat_template", None))
        self._fast_decode = _backend_decode(decoder)
        self._token_texts: dict[int, str] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    @classmethod
    def load(cls, model_dir: str, max_model_len: int | None = None) -> ModelTokenizer:
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory {model_dir!r} does not exist")
        limit = max_model_len or _context_length(path)
        if limit is None:
            raise ConfigError(f"{model_dir!r} has no context length in config.json: pass --max-model-len")
        return cls(_load_hf_tokenizer(path), _load_hf_tokenizer(path), limit)

    def close(self) -> None:
        self._worker.shutdown(wait=False)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.encode, text, add_special_tokens)

    async def apply_chat_template_async(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                                        continue_final_message: bool = False) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, self.apply_chat_template, messages, add_generation_prompt, continue_final_message)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw completion prompt: special tokens (BOS) added, as vLLM does. Worker thread only."""
        return list(self._encoder.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """Worker thread only (see the class comment)."""
        if not self.has_chat_template:
            raise PromptError("the model has no chat template; use /v1/completions")
        try:
            ids = self._encoder.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    continue_final_message=continue_final_message, tokenize=True,
                                                    return_dict=False)
        except (TemplateError, ValueError) as exc:  # the messages broke the template (raise_exception)
            raise PromptError(f"chat template error: {exc}") from exc
        return list(ids)

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
