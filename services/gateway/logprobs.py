"""Log probabilities in OpenAI's two shapes, as vLLM's server writes them.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A token the instance sent no probabilities for has a null logprob and no alternatives: only a
migration's repeat of a token from before the source's last step (whose logprobs the commit
carries), read by the client before the source's own chunk came.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from services.gateway.generation import TokenWithLogprob

MIN_LOGPROB = -9999.0  # vLLM's floor: -inf is not JSON


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobsFormatter:
    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._text = token_text

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": None if logprob is None else _value(logprob),
                "bytes": list(text.encode("utf-8", errors="replace"))}

    def chat(self, tokens: Sequence[TokenWithLogprob]) -> dict[str, Any]:
        content = []
        for token_id, logprob in tokens:
            entry = self._entry(token_id, None if logprob is None else logprob.logprob)
            entry["top_logprobs"] = [] if logprob is None else [self._entry(t, lp) for t, lp in logprob.top]
            content.append(entry)
        return {"content": content}

    def completion(self, tokens: Sequence[TokenWithLogprob], text_offset: int) -> dict[str, Any]:
        """`text_offset`: where the first token's text starts in the choice's whole output."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob in tokens:
            text = self._text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if logprob is None else _value(logprob.logprob))
            out["top_logprobs"].append(None if logprob is None else
                                       {self._text(t): _value(lp) for t, lp in logprob.top})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out
