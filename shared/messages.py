"""Wire messages between Corral services: typed, MessagePack-encoded, validated on decode.

Every message that crosses NATS is defined here and nowhere else. `encode`/`decode` are the only
way in and out: a malformed payload raises `WireError` at the edge instead of an AttributeError
deep inside a handler.
"""

from __future__ import annotations

import enum
import logging
from typing import TypeVar

import msgspec

T = TypeVar("T")


class WireError(ValueError):
    """A payload that does not decode into the expected message type."""


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Refusal(str, enum.Enum):
    """Why a request was not taken. The gateway maps each to an HTTP status and a metric label, so
    no one reads meaning out of the accompanying message text."""

    TOO_LONG = "too_long"  # the prompt (with its output budget) does not fit the context: 400
    INVALID = "invalid"  # a malformed or out-of-range request (bad token id, bad sampling): 400
    DUPLICATE = "duplicate"  # the request id is already running there: 409
    DRAINING = "draining"  # the instance is leaving; another may take the request: 503
    OVERLOADED = "overloaded"  # early rejection, every instance too loaded: 429, retry later
    NO_INSTANCE = "no_instance"  # no live instance at all: 503
    ENGINE_FAILED = "engine_failed"  # the instance's engine is not running: 503


class Struct(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Base for wire structs; unknown fields are ignored so old and new services interoperate."""


# ---------------------------------------------------------------------------------------------
# Requests and their output stream
# ---------------------------------------------------------------------------------------------


class SamplingParams(Struct):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    repetition_penalty: float = 1.0
    # Log probabilities of each output token and of this many top alternatives (OpenAI's
    # top_logprobs; 0: the sampled token's only). None: none (engines that cannot refuse it).
    logprobs: int | None = None


class GenerateRequest(Struct):
    """Gateway → llumlet: run this request and stream its tokens to `reply_subject`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str
    priority: int = 0
    arrival_time: float = 0.0
    # Output length a trace asked for (the simulated engine stops there); None: until max_tokens/EOS.
    target_output_len: int | None = None
    # W3C trace context (`traceparent`, `tracestate`) of the gateway's request span. It arrives in
    # the generate message's NATS headers; the llumlet keeps it here so that it travels with the
    # request through migrations (the commit carries the request).
    trace_context: dict[str, str] | None = None


class TokenLogprob(msgspec.Struct, array_like=True):
    """One output token's log probability and the top alternatives', best first (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]] = []


class TokenChunk(Struct):
    """Llumlet → gateway: new output tokens of one request, starting at token index `start_index`.

    Whichever instance holds the request publishes; after a migration the destination continues
    from the next index, so the gateway orders by index and drops what it has already seen.
    """

    request_id: str
    instance_id: str
    start_index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    # The destination of a migration, taking the request over (its first chunk repeats the output
    # so far): the gateway watches this instance from now on, even when the chunk adds nothing.
    handover: bool = False
    # One per token of `token_ids`, when the request asked for logprobs (None on a handover's
    # repeat of the output so far: the destination never saw those probabilities).
    logprobs: list[TokenLogprob] | None = None


class AbortRequest(Struct):
    request_id: str
    reason: str = "client disconnected"


class Ack(Struct):
    ok: bool
    error: str | None = None  # for people: what went wrong, in words
    reason: Refusal | None = None  # for code: set on a refused generate request


# ---------------------------------------------------------------------------------------------
# Load reports and dispatch
# ---------------------------------------------------------------------------------------------


class PriorityLoad(Struct):
    """Aggregates of one priority level on one instance (lower value = more important)."""

    priority: int
    num_running: int = 0
    running_blocks: int = 0
    num_waiting: int = 0
    waiting_demand_blocks: int = 0


class LoadReport(Struct):
    """Llumlet → global scheduler (and gateways, for bypass mode): one instance's load.

    Carries the raw numbers; freeness is computed from them by the pure functions in
    `shared.policy`, so the scheduler, the gateway's bypass path and the simulator agree.
    """

    instance_id: str
    seq: int
    sent_at: float
    num_blocks_total: int
    num_blocks_free: int
    block_size: int
    num_running: int
    num_waiting: int
    head_demand_blocks: int
    waiting_demand_blocks: int
    num_preemptions_total: int
    by_priority: list[PriorityLoad] = []
    num_migrating: int = 0
    reserved_blocks: int = 0
    # Blocks that admitted prompts still have to claim: admission checked their whole sequence
    # fits, chunked prefill allocates it chunk by chunk. Spoken for, though still free.
    committed_blocks: int = 0
    draining: bool = False
    kv_address: str = ""
    max_model_len: int = 0
    model: str = ""
    engine: str = ""
    # Freeness as the llumlet computed it (for dashboards); the scheduler recomputes.
    freeness: float = 0.0
    dispatch_freeness: float = 0.0


class DispatchRequest(Struct):
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0
    exclude: list[str] = []


class DispatchReply(Struct):
    instance_id: str | None = None
    rejected: str | None = None  # the refusal in words
    retry_after_s: float | None = None
    reason: Refusal | None = None  # set whenever `instance_id` is None


# ---------------------------------------------------------------------------------------------
# Migration orders (scheduler → llumlet) and handshake (llumlet ↔ llumlet)
# ---------------------------------------------------------------------------------------------


class MigrateOrder(Struct):
    """Scheduler → source llumlet: keep migrating to `dst_instance_id` while the pair stands."""

    pair_id: str
    dst_instance_id: str
    cancel: bool = False
    round: int = 0


class DrainOrder(Struct):
    drain: bool = True


class ScalingAction(str, enum.Enum):
    SCALE_OUT = "scale_out"
    DRAIN = "drain"
    STOPPED = "stopped"


class ScalingEvent(Struct):
    """Autoscaler → observers: an instance was started, asked to drain, or stopped."""

    action: ScalingAction
    instance_id: str
    instances: int
    at: float
    average_freeness: float | None = None


class PreAlloc(Struct):
    migration_id: str
    request_id: str
    num_blocks: int
    lease_s: float
    stage: int


class PreAllocReply(Struct):
    ok: bool
    reason: str | None = None
    block_ids: list[int] = []
    kv_address: str = ""  # the destination's KV receiver (host:port) for the data plane


class MigrationAbort(Struct):
    migration_id: str
    reason: str = ""


class MigrationCommit(Struct):
    migration_id: str
    request: GenerateRequest
    output_token_ids: list[int]
    num_computed_tokens: int
    num_preemptions: int = 0
    # Instances the request has left (id -> wall-clock time it left), for the return-trip limit.
    departures: dict[str, float] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T]) -> T:
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad {type_.__name__} payload: {exc}") from exc


def decode_or_drop(data: bytes, type_: type[T], log: logging.Logger, what: str) -> T | None:
    """For fire-and-forget subjects: a bad payload is logged and dropped, never raised into a
    subscription callback (which would stall the subject)."""
    try:
        return decode(data, type_)
    except WireError as exc:
        log.warning("dropping a bad %s: %s", what, exc)
        return None


_encoder = msgspec.msgpack.Encoder()
