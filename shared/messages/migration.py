"""Migration orders (scheduler → llumlet), the P/D hand-off questions, drain and scaling
events, and the migration handshake (llumlet ↔ llumlet)."""

from __future__ import annotations

import enum
from typing import Annotated

from msgspec import Meta

from shared.messages.wire import Count, InstanceId, RequestId, Seconds, Struct, TokenIds
from shared.messages.streams import GenerateRequest, MAX_TAIL_LOGPROBS, TokenLogprob
from shared.messages.load import BlockHash, DrainSource, MAX_PREALLOC_HASHES

__all__ = [
    "MigrateOrder",
    "HandoffQuery",
    "HandoffAnswer",
    "DrainOrder",
    "ScalingAction",
    "ScalingEvent",
    "PreAlloc",
    "PreAllocReply",
    "MigrationAbort",
    "MigrationCommit",
    "CommitNotice",
]


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
    max_num_tokens: Count = 0  # the longest it can grow (prompt + max_tokens): the context it needs; 0: not said


class HandoffAnswer(Struct):
    """Scheduler → prefill llumlet: migrate the request to `dst_instance_id`; None: no decode
    instance has room, so it keeps decoding where it is."""

    dst_instance_id: InstanceId | None = None
    reason: Annotated[str, Meta(max_length=1024)] | None = None  # why none, in words


class DrainOrder(Struct):
    drain: bool = True
    by: DrainSource = DrainSource.OPERATOR  # reported back while draining (LoadReport.drained_by)


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
    # The destination holds its next engine step up to this long for a commit it was told is
    # imminent (`CommitNotice`), so the request joins that step; 0: it does not (send no notice).
    hold_max_s: Seconds = 0.0


class CommitNotice(Struct):
    """Source → destination (NATS publish, no reply), as the source asks to suspend the request
    for its last stage: the COMMIT should land in about `commit_in_s`. A destination that holds
    (`PreAllocReply.hold_max_s`) starts no step that would end after it, so the request's first
    step there begins at the commit, not after the step then in flight. `paced`: the source
    notices steps ahead (`--migration-notice-steps` > 1, again at each step), and the destination
    may pace its steps before the commit to meet it (`shared.policy.commit_hold`); absent (an
    older source), False."""

    migration_id: RequestId
    commit_in_s: Annotated[float, Meta(ge=0.0, le=60.0)]
    paced: bool = False


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
    # The instance the request leaves: the destination's handover names it to the gateway, which
    # tells a migration out of a holder it gave up on (a second copy) from one out of the holder.
    source_instance_id: InstanceId | None = None

    def __post_init__(self) -> None:
        if self.tail_logprobs is not None and len(self.tail_logprobs) > len(self.output_token_ids):
            raise ValueError(f"{len(self.tail_logprobs)} tail logprobs for {len(self.output_token_ids)} output tokens")
