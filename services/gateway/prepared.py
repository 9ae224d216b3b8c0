"""A client's request made ready for dispatch: the prompt checked against the context window and
the vocabulary, the output budget settled (vLLM 0.32's rules and wording). Pure: no NATS here."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass

from services.gateway.errors import ApiError, bad_request
from services.gateway.protocol import GenerationOptions, RequestKind
from shared.messages import Refusal


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, tokenized, with its output budget settled."""

    kind: RequestKind
    request_id: str  # unique inside Corral: the key of the output stream and of the engine's request
    response_id: str  # what the client sees (from X-Request-Id when given)
    prompt_token_ids: list[int]
    options: GenerationOptions
    priority: int
    max_tokens: int
    arrival: float  # time.monotonic()
    created: int  # unix seconds, the `created` of every chunk


def prepare_request(kind: RequestKind, prompt_token_ids: list[int], options: GenerationOptions, priority: int, *,
                    max_model_len: int, vocab_size: int, default_max_tokens: int | None,
                    response_id: str | None = None, arrival: float | None = None,
                    request_id: str | None = None) -> PreparedRequest:
    """Check the prompt against the context window and settle max_tokens (the prompt must leave
    room for one token; max_tokens is clamped to the room left). Raises ApiError (400)."""
    limit = max_model_len
    prompt_len = len(prompt_token_ids)
    if prompt_len == 0:
        raise bad_request("the prompt must not be empty", kind.prompt_param)
    if (refusal := context_refusal(kind, prompt_len, options, limit)) is not None:
        raise refusal
    # After the length check, and min/max (C speed): a client's list of ids may be a million long.
    if not (0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab_size):
        raise bad_request(f"token ids must be in [0, {vocab_size})", kind.prompt_param)
    budget = [limit - prompt_len]
    if options.max_tokens is not None:
        budget.append(options.max_tokens)
    elif default_max_tokens is not None:
        budget.append(default_max_tokens)
    request_id = request_id or f"{kind.id_prefix}-{uuid.uuid4().hex}"
    return PreparedRequest(
        kind=kind, request_id=request_id, response_id=response_id or request_id,
        prompt_token_ids=prompt_token_ids, options=options, priority=priority, max_tokens=min(budget),
        arrival=time.monotonic() if arrival is None else arrival, created=int(time.time()),
    )


def another_choice(first: PreparedRequest, options: GenerationOptions, response_id: str | None) -> PreparedRequest:
    """Choice i > 0 of the request `first` is choice 0 of: the same prompt, not checked again (a
    long prompt's check takes milliseconds, which n choices would make a stall for every
    client); only the sampling differs (its seed), so the budget settled for the first holds."""
    assert options.max_tokens == first.options.max_tokens, (options, first.options)
    request_id = f"{first.kind.id_prefix}-{uuid.uuid4().hex}"
    return dataclasses.replace(first, request_id=request_id, response_id=response_id or request_id, options=options)


def context_refusal(kind: RequestKind, prompt_len: int, options: GenerationOptions, limit: int) -> ApiError | None:
    """The 400 (vLLM's words) for a prompt of `prompt_len` tokens, or an output budget, that
    cannot fit a context of `limit` tokens; None when they fit. Also run where a large body is
    parsed (body_parsing), so that a prompt too long never comes back to the event loop."""
    if options.max_tokens is not None and options.max_tokens > limit:
        param = options.max_tokens_param
        return bad_request(f"{param}={options.max_tokens} cannot be greater than max_model_len={limit}. "
                           "Please request fewer output tokens.", param, Refusal.TOO_LONG)
    if prompt_len >= limit:
        room = ("which exceeds this limit even without any output tokens" if prompt_len > limit
                else "which leaves no room for output tokens")
        return bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt "
                           f"contains {prompt_len} input tokens, {room}. "
                           "Please reduce the length of the input prompt.", kind.prompt_param, Refusal.TOO_LONG)
    return None
