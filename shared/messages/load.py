"""Load reports and dispatch: what an instance reports (with its role), dispatch requests and
replies, and the KV-cache events and snapshots prefix-aware dispatch reads."""

from __future__ import annotations

import enum
import logging
from typing import Annotated

from msgspec import Meta

from shared import subjects
from shared.messages.wire import Count, InstanceId, Refusal, RequestId, Seconds, Struct, _no_nan, decode_own_or_drop

__all__ = [
    "PriorityLoad",
    "MAX_RUNNING_OUTPUTS",
    "MAX_OUTPUT_LENGTH_BINS",
    "DrainSource",
    "InstanceRole",
    "LoadReport",
    "decode_load_report",
    "MAX_BLOCK_HASHES",
    "BlockHash",
    "MAX_PREALLOC_HASHES",
    "MAX_CANDIDATE_HASHES",
    "DispatchRequest",
    "MAX_SNAPSHOT_HASHES",
    "HASHES_PER_MESSAGE",
    "KvCacheEvents",
    "KvCacheSnapshot",
    "DispatchReply",
]


class PriorityLoad(Struct):
    """Aggregates of one priority level on one instance (lower value = more important)."""

    priority: int
    num_running: Count = 0
    running_blocks: Count = 0
    num_waiting: Count = 0
    waiting_demand_blocks: Count = 0


MAX_RUNNING_OUTPUTS = 1024  # a load report lists at most this many running requests' outputs


MAX_OUTPUT_LENGTH_BINS = 64  # bins of a load report's served-output histogram (admission uses 34)


class DrainSource(enum.StrEnum):
    """Who made an instance drain: an operator's tool (`corral drain`, a preStop), the autoscaler
    (it stops the instance once empty, and a restarted autoscaler picks up where it left off), or
    the instance's own stop (SIGTERM)."""

    OPERATOR = "operator"
    AUTOSCALER = "autoscaler"
    STOPPING = "stopping"


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
    # Of them, migrations into it (P/D hand-offs among them), and how many it takes at once (its
    # --migration-max-in; 0: not told, an older llumlet): at its limit it refuses the next one,
    # so a hand-off goes elsewhere.
    num_migrating_in: Count = 0
    max_migrations_in: Count = 0
    reserved_blocks: Count = 0
    # Blocks that admitted prompts still have to claim: admission checked their whole sequence
    # fits, chunked prefill allocates it chunk by chunk. Spoken for, though still free.
    committed_blocks: Count = 0
    # Tokens the waiting requests will prefill, each less the prefix this instance's cache holds
    # for it now (None: not told, an engine without a prefix cache or an older llumlet; the
    # waiting demand's blocks, cached ones included, stand in). Prefix-aware dispatch counts the
    # prefixes left out at `--prefix-cached-queue-weight` where told, and each request held or
    # queued as `--prefix-held-request-tokens` more on every instance (`shared.policy.prefix_dispatch`).
    waiting_prefill_tokens: Count | None = None
    draining: bool = False
    drained_by: DrainSource | None = None  # set while draining
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
    # Migrations into it it has answered since it started, granted or refused (their first
    # PRE-ALLOC; P/D hand-offs among them): the scheduler tells by it which of its hand-offs a
    # report does not show yet.
    num_migrations_asked_total: Count = 0
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
        if self.num_migrating_in > self.num_migrating:
            raise ValueError(f"{self.num_migrating_in} migrations in of {self.num_migrating}")


def decode_load_report(data: bytes, log: logging.Logger, subject: str) -> LoadReport | None:
    """A load report heard on `subject`, or None (counted, logged): a bad payload, or one about
    another instance than the subject's (every subscriber to `LOAD_REPORTS_ALL` reads them so)."""
    return decode_own_or_drop(data, LoadReport, log, "load report", subject,
                              lambda report: subjects.load_report(report.instance_id))


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
# What one KV message carries: a larger snapshot is a `KvCacheSnapshot` of this many, the rest
# stores numbered after it (the llumlet sends so, the scheduler's index knows a first part by it).
HASHES_PER_MESSAGE = 50_000  # ~0.5 MB: under NATS's default 1 MiB payload


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
