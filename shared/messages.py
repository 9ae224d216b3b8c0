"""Wire messages between Corral services: typed, MessagePack-encoded, validated on decode.

Every message that crosses NATS is defined here and nowhere else. `encode`/`decode` are the only
way in and out: a malformed payload raises `WireError` at the edge instead of an AttributeError
deep inside a handler.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from shared import bus_guard

T = TypeVar("T")


class WireError(ValueError):
    """A payload that does not decode into the expected message type. `reason` (a metric label):
    malformed (not MessagePack), invalid (wrong schema or a value out of bounds), oversized, nested."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


# Constraints checked on decode (never on construction: a service's own messages are trusted).
# Everything a peer sends is bounded here, once, so no handler divides by a zero block size,
# publishes to a subject with a space in it or allocates for a billion-entry list.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # NATS' own limit is 1 MiB unless raised; a frame cap regardless
MAX_LIST = 1 << 20  # tokens of one request (context lengths stay far below)
InstanceId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_\-]+$", max_length=128)]  # = subjects.valid_token
RequestId = Annotated[str, Meta(min_length=1, max_length=256)]
# A NATS subject one may publish to: dot-separated non-empty tokens, no whitespace, no wildcard.
Subject = Annotated[str, Meta(pattern=r"^[^\s.*>]+(\.[^\s.*>]+)*$", max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**53)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_LIST)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e12)]  # a duration or a wall-clock time: finite, not negative


def _no_nan(**values: float) -> None:
    """Called from `__post_init__`, which runs on decode too (msgspec turns the error into a
    ValidationError): NaN compares false with everything, so it would slip through every policy."""
    for name, value in values.items():
        if value is not None and math.isnan(value):
            raise ValueError(f"{name} is NaN")


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


# ---------------------------------------------------------------------------------------------
# Load reports and dispatch
# ---------------------------------------------------------------------------------------------


class PriorityLoad(Struct):
    """Aggregates of one priority level on one instance (lower value = more important)."""

    priority: int
    num_running: Count = 0
    running_blocks: Count = 0
    num_waiting: Count = 0
    waiting_demand_blocks: Count = 0


MAX_RUNNING_OUTPUTS = 1024  # a load report lists at most this many running requests' outputs
MAX_OUTPUT_LENGTH_BINS = 64  # bins of a load report's served-output histogram (admission uses 34)


class InstanceRole(enum.StrEnum):
    """What an instance serves (issue 19 §2): `prefill` instances take new requests and hand each
    one, at its first token, to a `decode` instance by live migration; `mixed` does both."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class LoadReport(Struct):
    """Llumlet → global scheduler (and gateways, for bypass mode): one instance's load.

    Carries the raw numbers; freeness is computed from them by the pure functions in
    `shared.policy`, so the scheduler, the gateway's bypass path and the simulator agree.
    """

    instance_id: InstanceId
    seq: Count
    sent_at: Seconds
    num_blocks_total: Count
    num_blocks_free: Count
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    num_running: Count
    num_waiting: Count
    head_demand_blocks: Count
    waiting_demand_blocks: Count
    num_preemptions_total: Count
    by_priority: Annotated[list[PriorityLoad], Meta(max_length=1024)] = []
    num_migrating: Count = 0
    reserved_blocks: Count = 0
    # Blocks that admitted prompts still have to claim: admission checked their whole sequence
    # fits, chunked prefill allocates it chunk by chunk. Spoken for, though still free.
    committed_blocks: Count = 0
    draining: bool = False
    kv_address: Annotated[str, Meta(max_length=256)] = ""
    max_model_len: Count = 0
    model: str = ""
    engine: str = ""
    role: InstanceRole = InstanceRole.MIXED
    # For admission's `predicted` policy (issue 19 §1): each running request's output so far, and
    # the requests this instance has finished with their output tokens, in total and as counts per
    # output-length bin (`shared.policy.admission.OUTPUT_BIN_EDGES`: its output-length estimate).
    running_output_tokens: Annotated[list[Count], Meta(max_length=MAX_RUNNING_OUTPUTS)] = []
    num_finished_total: Count = 0
    finished_output_tokens_total: Count = 0
    finished_output_histogram: Annotated[list[Count], Meta(max_length=MAX_OUTPUT_LENGTH_BINS)] = []
    # Generate orders it has accepted since it started: the scheduler's admission tells by it
    # which of its dispatches a report does not show yet (sent after the report was built).
    num_accepted_total: Count = 0
    # The leading block hashes (shared.prefix_hash) of the request this instance would migrate
    # out next: pairing prefers a destination whose cache holds them (issue 18 §4).
    migration_candidate_hashes: Annotated[list[BlockHash], Meta(max_length=MAX_CANDIDATE_HASHES)] = []
    # The pace of its recent decoding steps (exponential averages; 0: none yet): wall time,
    # requests decoded per step and their context tokens. Over the latency model's decode-only
    # time for that batch they give the step inflation admission scales its TBT predictions by.
    step_time_s: Seconds = 0.0
    step_decode_batch: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0
    step_decode_context: Annotated[float, Meta(ge=0.0, le=1e12)] = 0.0
    # Freeness as the llumlet computed it (for dashboards); the scheduler recomputes.
    freeness: float = 0.0
    dispatch_freeness: float = 0.0

    def __post_init__(self) -> None:
        _no_nan(freeness=self.freeness, dispatch_freeness=self.dispatch_freeness)
        if self.num_blocks_free > self.num_blocks_total:
            raise ValueError(f"{self.num_blocks_free} free blocks of {self.num_blocks_total}")


MAX_BLOCK_HASHES = 1 << 16  # a million-token prompt at 16 tokens a block; ~0.6 MB on the wire
BlockHash = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # shared.prefix_hash: 63 bits, non-negative
MAX_PREALLOC_HASHES = 4096  # a migration's cached prefix, at most (64k tokens at 16 a block)
MAX_CANDIDATE_HASHES = 256  # a load report's migration candidate prefix, at most (4k tokens at 16)


class DispatchRequest(Struct):
    request_id: RequestId
    num_prompt_tokens: Count
    max_tokens: Count
    priority: int = 0
    exclude: Annotated[list[InstanceId], Meta(max_length=1024)] = []
    # The prompt's chained full-block hashes (shared.prefix_hash) at `prefix_block_size` tokens
    # a block, for prefix-aware dispatch; empty when the gateway did not hash the prompt.
    block_hashes: Annotated[list[BlockHash], Meta(max_length=MAX_BLOCK_HASHES)] = []
    prefix_block_size: Annotated[int, Meta(ge=0, le=1 << 20)] = 0


MAX_SNAPSHOT_HASHES = 1 << 20  # a large GPU's KV cache in blocks; a snapshot may need chunking


class KvCacheEvents(Struct):
    """Llumlet → scheduler: the block hashes (shared.prefix_hash) its engine's prefix cache
    stored and evicted since the last message, in order (vLLM's KV events, translated)."""

    instance_id: InstanceId
    seq: Count  # per instance, +1 a message: a gap tells the index to ask for a snapshot
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    stored: Annotated[list[BlockHash], Meta(max_length=MAX_BLOCK_HASHES)] = []
    removed: Annotated[list[BlockHash], Meta(max_length=MAX_BLOCK_HASHES)] = []
    cleared: bool = False  # everything was dropped before `removed`/`stored` (vLLM's AllBlocksCleared)


class KvCacheSnapshot(Struct):
    """Llumlet → scheduler: every block hash its cache holds after event `seq`."""

    instance_id: InstanceId
    seq: Count
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    block_hashes: Annotated[list[BlockHash], Meta(max_length=MAX_SNAPSHOT_HASHES)] = []


class DispatchReply(Struct):
    instance_id: InstanceId | None = None
    rejected: str | None = None  # the refusal in words
    retry_after_s: float | None = None
    reason: Refusal | None = None  # set whenever `instance_id` is None
    # Admission control's predicted TTFT on the chosen instance (None without admission): the
    # gateway reports how far the measured TTFT strays from it.
    predicted_ttft_s: Seconds | None = None


# ---------------------------------------------------------------------------------------------
# Migration orders (scheduler → llumlet) and handshake (llumlet ↔ llumlet)
# ---------------------------------------------------------------------------------------------


class MigrateOrder(Struct):
    """Scheduler → source llumlet: keep migrating to `dst_instance_id` while the pair stands."""

    pair_id: Annotated[str, Meta(max_length=256)]
    dst_instance_id: InstanceId
    cancel: bool = False
    round: Count = 0


class HandoffQuery(Struct):
    """Prefill llumlet → scheduler, when a request's prefill completes (its first token): which
    decode instance takes it now? (issue 19 §2: the destination is chosen then, not at arrival.)"""

    instance_id: InstanceId
    request_id: RequestId
    num_blocks: Count  # the request's KV blocks, the room the destination needs


class HandoffAnswer(Struct):
    """Scheduler → prefill llumlet: migrate the request to `dst_instance_id`; None: no decode
    instance has room, so it keeps decoding where it is."""

    dst_instance_id: InstanceId | None = None
    reason: Annotated[str, Meta(max_length=1024)] | None = None  # why none, in words


class DrainOrder(Struct):
    drain: bool = True


class ScalingAction(str, enum.Enum):
    SCALE_OUT = "scale_out"
    DRAIN = "drain"
    STOPPED = "stopped"


class ScalingEvent(Struct):
    """Autoscaler → observers: an instance was started, asked to drain, or stopped."""

    action: ScalingAction
    instance_id: InstanceId
    instances: Count
    at: float
    average_freeness: float | None = None


class PreAlloc(Struct):
    migration_id: RequestId
    request_id: RequestId
    num_blocks: Annotated[int, Meta(ge=0, le=1 << 24)]
    lease_s: Seconds
    stage: Annotated[int, Meta(ge=0, le=1024)]
    # Stage 0: the request's leading full-block hashes (shared.prefix_hash), so the destination
    # can bind it to the cached blocks of its prefix it holds; the source then skips those.
    block_hashes: Annotated[list[BlockHash], Meta(max_length=MAX_PREALLOC_HASHES)] = []


class PreAllocReply(Struct):
    ok: bool
    reason: str | None = None
    block_ids: Annotated[list[Count], Meta(max_length=1 << 24)] = []
    kv_address: Annotated[str, Meta(max_length=256)] = ""  # the destination's KV receiver (host:port) for the data plane
    # Leading blocks of the lease the destination's prefix cache held (pinned there): not sent.
    num_cached_blocks: Count = 0


class MigrationAbort(Struct):
    migration_id: RequestId
    reason: str = ""


class MigrationCommit(Struct):
    migration_id: RequestId
    request: GenerateRequest
    output_token_ids: TokenIds
    num_computed_tokens: Count
    num_preemptions: Count = 0
    # Instances the request has left (id -> wall-clock time it left), for the return-trip limit.
    departures: dict[str, float] = {}
    # Logprobs of the last len(tail_logprobs) output tokens (the source's last step, when the
    # request asked for them): its chunk may reach the gateway after the destination's catch-up,
    # which then carries them, so no token of the stream goes without.
    tail_logprobs: Annotated[list[TokenLogprob], Meta(max_length=MAX_TAIL_LOGPROBS)] | None = None

    def __post_init__(self) -> None:
        if self.tail_logprobs is not None and len(self.tail_logprobs) > len(self.output_token_ids):
            raise ValueError(f"{len(self.tail_logprobs)} tail logprobs for {len(self.output_token_ids)} output tokens")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T]) -> T:
    if len(data) > MAX_PAYLOAD_BYTES:
        raise WireError(f"bad {type_.__name__} payload: {len(data)} bytes (at most {MAX_PAYLOAD_BYTES})",
                        "oversized")
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise WireError(f"bad {type_.__name__} payload: {exc}", "invalid") from exc
    except msgspec.DecodeError as exc:
        raise WireError(f"bad {type_.__name__} payload: {exc}", "malformed") from exc
    except RecursionError as exc:  # nesting deeper than the interpreter's stack, from any peer
        raise WireError(f"bad {type_.__name__} payload: nested too deeply", "nested") from exc


def decode_or_drop(data: bytes, type_: type[T], log: logging.Logger, what: str, subject: str = "") -> T | None:
    """For fire-and-forget subjects: a bad payload is counted (`shared.bus_guard`), logged
    (rate-limited) and dropped, never raised into a subscription callback."""
    try:
        return decode(data, type_)
    except WireError as exc:
        bus_guard.rejected(subject, exc.reason, str(exc), log, what)
        return None


_encoder = msgspec.msgpack.Encoder()
