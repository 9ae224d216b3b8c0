"""Translate between Corral's request messages and vLLM's: checks, sampling parameters, finish reasons.

Everything here runs on the caller's thread before a request reaches the engine thread, so a
request vLLM would refuse fails in `add_request` with a clear `EngineError` instead of inside a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shared.engine_model.views import EngineError
from shared.messages import FinishReason, GenerateRequest, Refusal, TokenLogprob

if TYPE_CHECKING:
    import vllm

# vLLM's CompletionOutput.finish_reason strings. "repetition" is vLLM's repetition detector
# stopping a request: a normal stop as far as a client is concerned.
FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.STOP,
}


def finish_reason_of(vllm_reason: str | None) -> FinishReason:
    """A finished request's reason; one vLLM does not name is an error, never silence."""
    return FINISH_REASONS.get(vllm_reason or "", FinishReason.ERROR)


def logprobs_of(token_ids: Sequence[int], positions: Sequence[Mapping[int, Any]], top: int) -> list[TokenLogprob]:
    """vLLM's per-token logprobs (each position: the sampled token and the top `top`, as
    {token id: Logprob(logprob, rank)}) → ours: the sampled token's, and the top ones best first."""
    out = []
    for token_id, position in zip(token_ids, positions, strict=True):
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank is not None and lp.rank <= top)
        out.append(TokenLogprob(_not_nan(position[token_id].logprob),
                                [(t, _not_nan(logprob)) for _rank, t, logprob in ranked]))
    return out


def _not_nan(logprob: float) -> float:
    """NaN (a broken distribution, e.g. an overflow in half precision) is refused on the wire
    and is no JSON: it goes out as -inf, which the gateway writes as vLLM's floor (-9999.0)."""
    return -math.inf if math.isnan(logprob) else logprob


def check_request(request: GenerateRequest, *, max_model_len: int, vocab_size: int) -> None:
    """Raise EngineError if the request can never run on this engine."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise EngineError(f"request {request.request_id}: the prompt is empty")
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise EngineError(
            f"request {request.request_id}: token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    max_tokens = request.sampling.max_tokens
    if max_tokens < 1:
        raise EngineError(f"request {request.request_id}: max_tokens must be at least 1, got {max_tokens}")
    if len(prompt) + max_tokens > max_model_len:
        raise EngineError(
            f"request {request.request_id}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
            f"exceeds max_model_len {max_model_len}", Refusal.TOO_LONG
        )


def to_vllm_sampling_params(request: GenerateRequest) -> vllm.SamplingParams:
    """vLLM sampling parameters streaming per-step token deltas, without detokenization
    (the gateway detokenizes)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    sampling = request.sampling
    try:
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
            min_tokens=sampling.min_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            repetition_penalty=sampling.repetition_penalty,
            logprobs=sampling.logprobs,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
    except (VLLMClientError, ValueError, TypeError) as error:
        raise EngineError(f"request {request.request_id}: {error}") from error
