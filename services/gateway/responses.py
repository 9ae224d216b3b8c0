"""OpenAI response objects and SSE framing for chat and text completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.errors import ApiError
from services.gateway.protocol import RequestKind

SSE_DONE = b"data: [DONE]\n\n"

_json = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def json_bytes(payload: dict[str, Any]) -> bytes:
    return _json.encode(payload)


def sse_error(error: ApiError) -> bytes:
    return sse_event(error.body())


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens found in the prefix cache, shown as vLLM's `prompt_tokens_details` (None: left out).
    cached_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


@dataclass(frozen=True)
class ResponseFormatter:
    """Builds every object of one response; `id` and `created` are the same on all of them."""

    kind: RequestKind
    response_id: str
    created: int
    model: str

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind is RequestKind.CHAT else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """A choice's first chat chunk, as vLLM sends it: the role and empty content."""
        assert self.kind is RequestKind.CHAT
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._envelope(self._chunk_object, [choice])

    def text_chunk(self, text: str, finish_reason: str | None, usage: Usage | None = None,
                   index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind is RequestKind.CHAT:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = self._envelope(self._chunk_object, [choice])
        if usage is not None:
            chunk["usage"] = usage.as_dict()
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """`stream_options.include_usage`: one last chunk with no choices."""
        chunk = self._envelope(self._chunk_object, [])
        chunk["usage"] = usage.as_dict()
        return chunk

    def full_response(self, texts: list[str], finish_reasons: list[str], usage: Usage,
                      logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
        """The whole response; one choice per text, indexed in order (`n` > 1 gives several)."""
        choices = []
        logprobs = logprobs or [None] * len(texts)
        for index, (text, finish_reason, lp) in enumerate(zip(texts, finish_reasons, logprobs, strict=True)):
            if self.kind is RequestKind.CHAT:
                message = {"role": "assistant", "content": text}
                choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason})
        response = self._envelope("chat.completion" if self.kind is RequestKind.CHAT else "text_completion", choices)
        response["usage"] = usage.as_dict()
        return response
