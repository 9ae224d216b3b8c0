"""Requests and their output stream: generate orders, sampling, token chunks (and their
per-gateway batches), aborts, heartbeats and acks."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta

from shared.messages.wire import (
    Count,
    FinishReason,
    InstanceId,
    Refusal,
    RequestId,
    Struct,
    Subject,
    TokenId,
    TokenIds,
    _no_nan,
    decode,
)

__all__ = [
    "SamplingParams",
    "GenerateRequest",
    "TokenLogprob",
    "TokenChunk",
    "MAX_BATCH_CHUNKS",
    "MAX_TAIL_LOGPROBS",
    "TokenChunkBatch",
    "decode_chunks",
    "AbortRequest",
    "SchedulerHeartbeat",
    "GatewayHeartbeat",
    "Ack",
]


class SamplingParams(Struct):
    max_tokens: Count = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: TokenIds = []
    repetition_penalty: float = 1.0
    # Log probabilities of each output token and of this many top alternatives (OpenAI's
    # top_logprobs; 0: the sampled token's only). None: none (engines that cannot refuse it).
    logprobs: int | None = None


class GenerateRequest(Struct):
    """Gateway → llumlet: run this request and stream its tokens to `reply_subject`."""

    request_id: RequestId
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    reply_subject: Subject
    priority: int = 0
    arrival_time: float = 0.0
    # Output length a trace asked for (the simulated engine stops there); None: until max_tokens/EOS.
    target_output_len: int | None = None
    # A resume by recompute (the request's instance died or left): the prompt ends with this many
    # tokens the request already output. Output indices continue from here, and an engine whose
    # tokens are not a function of the text (the simulator's synthetic stream) continues its own.
    resume_from: Count = 0
    # W3C trace context (`traceparent`, `tracestate`) of the gateway's request span. It arrives in
    # the generate message's NATS headers; the llumlet keeps it here so that it travels with the
    # request through migrations (the commit carries the request).
    trace_context: dict[str, str] | None = None
    # The gateway takes a `TokenChunkBatch` on `reply_subject`: a llumlet sends one message per
    # engine step for all of that gateway's requests it holds, not one per request.
    batched_output: bool = False


class TokenLogprob(msgspec.Struct, array_like=True):
    """One output token's log probability and the top alternatives', best first (id, logprob).
    -inf is a probability of zero (the gateway writes vLLM's floor, -9999.0); NaN is refused."""

    logprob: float
    top: Annotated[list[tuple[TokenId, float]], Meta(max_length=1024)] = []

    def __post_init__(self) -> None:
        _no_nan(logprob=self.logprob)
        if any(math.isnan(value) for _token, value in self.top):
            raise ValueError("a top logprob is NaN")


class TokenChunk(Struct):
    """Llumlet → gateway: new output tokens of one request, starting at token index `start_index`.

    Whichever instance holds the request publishes; after a migration the destination continues
    from the next index, so the gateway orders by index and drops what it has already seen.
    """

    request_id: RequestId
    instance_id: InstanceId
    start_index: Count
    token_ids: TokenIds
    finish_reason: FinishReason | None = None
    error: Annotated[str, Meta(max_length=4096)] | None = None
    num_prompt_tokens: Count = 0
    num_preemptions: Count = 0
    # The destination of a migration, taking the request over (its first chunk repeats the output
    # so far): the gateway watches this instance from now on, even when the chunk adds nothing.
    handover: bool = False
    # On an error chunk: the instance gave the request up whole (it is stopping, or its engine
    # failed), so the gateway may resume it elsewhere from the tokens it delivered.
    resumable: bool = False
    # One per token of `token_ids`, when the request asked for logprobs (None on a handover's
    # repeat of the output so far, but for the source's last step: `MigrationCommit.tail_logprobs`).
    logprobs: list[TokenLogprob] | None = None
    # On an instance's first output of the request: prompt tokens its engine found in the prefix
    # cache (vLLM's num_cached_tokens; None: not the first output, or the engine keeps no cache).
    num_cached_tokens: Count | None = None
    # On a handover: the migration's source. A gateway that gave up on that instance (it resumed
    # the request elsewhere) takes a late commit's copy for a second one, and aborts it there.
    handover_from: InstanceId | None = None


MAX_BATCH_CHUNKS = 4096


MAX_TAIL_LOGPROBS = 256  # output tokens of one engine step (more than one with speculative decoding)


class TokenChunkBatch(msgspec.Struct, array_like=True):
    """Llumlet → gateway, on the gateway's output subject: one engine step's chunks of that
    gateway's requests (those that set `GenerateRequest.batched_output`). A MessagePack array,
    where a `TokenChunk` is a map: `decode_chunks` tells them apart by the first byte."""

    chunks: Annotated[list[TokenChunk], Meta(min_length=1, max_length=MAX_BATCH_CHUNKS)]


def decode_chunks(data: bytes) -> list[TokenChunk]:
    """A gateway output subject's payload: one `TokenChunk`, or a `TokenChunkBatch` of several."""
    if data and (0x90 <= data[0] <= 0x9F or data[0] in (0xDC, 0xDD)):  # fixarray, array 16, array 32
        return decode(data, TokenChunkBatch).chunks
    return [decode(data, TokenChunk)]


class AbortRequest(Struct):
    request_id: RequestId
    reason: str = "client disconnected"
    # The gateway that sent it; an abort from anyone else (an operator, another gateway) ends the
    # request's stream with an error, since its own gateway is still waiting for tokens.
    gateway_id: InstanceId | None = None
    # Only this instance drops its copy (one a resume left behind); None: every instance.
    instance_id: InstanceId | None = None


class SchedulerHeartbeat(Struct):
    """Each global scheduler replica, every few hundred ms: the live one with the lowest id pairs
    migrations (services/global_scheduler/leadership.py)."""

    scheduler_id: InstanceId


class GatewayHeartbeat(Struct):
    """Each gateway, every `interval_s`: llumlets abort the requests of a gateway gone silent
    (nobody would read their tokens)."""

    gateway_id: InstanceId
    interval_s: Annotated[float, Meta(gt=0.0, le=60.0)]


class Ack(Struct):
    ok: bool
    error: str | None = None  # for people: what went wrong, in words
    reason: Refusal | None = None  # for code: set on a refused generate request
