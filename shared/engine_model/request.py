"""One request as the simulated engine sees it: lengths, progress and lifecycle timestamps.

Token bookkeeping follows vLLM v1: `num_tokens` = prompt + generated tokens, and
`num_computed_tokens` counts the tokens whose KV exists. A step that brings
`num_computed_tokens` up to `num_tokens` samples one new token; a partial (chunked) prefill does
not. The last sampled token's KV is computed by the next step, so a decoding request always has
`num_computed_tokens == num_tokens - 1` between steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.messages import FinishReason


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # requeued at the front of the waiting queue, KV dropped (recompute)
    SUSPENDED = 3  # out of the batch for the last migration stage, blocks kept
    # Everything after SUSPENDED is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_MIGRATED = 7  # handed over to another instance; produces no output here

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.SUSPENDED


FINISH_REASONS: dict[RequestStatus, FinishReason | None] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_MIGRATED: None,
}

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    target_output_len: int | None = None  # a trace's output length: stop there (FinishReason.STOP)
    priority: int = 0  # lower value = more important
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    # Chained hashes of the prompt's full blocks (shared.prefix_hash), for the prefix cache.
    block_hashes: tuple[int, ...] = ()
    # Prompt tokens found in the prefix cache at the first admission (vLLM's num_cached_tokens).
    num_cached_tokens: int = 0
    # Token ids are kept by the live engine only; the simulator leaves this empty.
    output_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Output count at which the request stops, and how; set by the scheduler at admission
    # (it also depends on the instance's maximum sequence length).
    stop_at_output: int = 0
    stop_status: RequestStatus = RequestStatus.FINISHED_LENGTH
    # Metrics timestamps (engine clock; virtual time in the simulator).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_token_time: float | None = None  # (a migration's stall runs from its last token on the source)
    # Preemption loss: time from a preemption until the request has recomputed what it lost.
    preempted_at: float | None = None
    preemption_loss_s: float = 0.0
    num_recomputed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output_tokens

    @property
    def expected_output_len(self) -> int:
        """Output length the SJF queue assumes (a trace's target when given, else max_tokens)."""
        target = self.target_output_len
        return self.max_tokens if target is None else min(target, self.max_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.SUSPENDED

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def set_stop(self, max_seq_len: int) -> None:
        """Decide where generation ends: max_tokens or the sequence limit (LENGTH), or an
        earlier trace target (STOP)."""
        stop_at, status = self.max_tokens, RequestStatus.FINISHED_LENGTH
        target = self.target_output_len
        if target is not None and target < stop_at:
            stop_at, status = max(target, 1), RequestStatus.FINISHED_STOPPED
        seq_room = max_seq_len - self.prompt_len
        if seq_room < stop_at:
            stop_at, status = seq_room, RequestStatus.FINISHED_LENGTH
        assert stop_at >= 1, (self.request_id, stop_at)
        self.stop_at_output, self.stop_status = stop_at, status

    # -- transitions ---------------------------------------------------------------------------

    def start_running(self, now: float, num_cached_tokens: int = 0) -> None:
        """Into the batch; the first `num_cached_tokens` come from the prefix cache (computed)."""
        assert self.status in _QUEUED, (self.request_id, self.status)
        assert self.num_computed_tokens == 0
        assert 0 <= num_cached_tokens < self.num_tokens, (self.request_id, num_cached_tokens)
        self.status = RequestStatus.RUNNING
        self.num_computed_tokens = num_cached_tokens
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
            self.num_cached_tokens = num_cached_tokens

    def start_migrated_in(self) -> None:
        """Destination side of a migration: enter the batch with the KV that was copied in."""
        assert self.status == RequestStatus.WAITING, (self.request_id, self.status)
        assert 0 < self.num_computed_tokens < self.num_tokens, (self.num_computed_tokens, self.num_tokens)
        self.status = RequestStatus.RUNNING

    def preempt(self, now: float) -> None:
        """Recompute preemption: the KV is dropped and must be computed again."""
        assert self.status == RequestStatus.RUNNING, (self.request_id, self.status)
        self.status = RequestStatus.PREEMPTED
        self.num_recomputed_tokens += self.num_computed_tokens
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        if self.preempted_at is None:  # a second preemption before recovering extends the loss
            self.preempted_at = now

    def suspend(self) -> None:
        assert self.status == RequestStatus.RUNNING, (self.request_id, self.status)
        self.status = RequestStatus.SUSPENDED

    def resume(self) -> None:
        assert self.status == RequestStatus.SUSPENDED, (self.request_id, self.status)
        self.status = RequestStatus.RUNNING

    def finish(self, status: RequestStatus, now: float) -> None:
        assert status.is_finished, status
        assert not self.is_finished, (self.request_id, self.status)
        if status == RequestStatus.FINISHED_MIGRATED:
            assert self.status == RequestStatus.SUSPENDED, (self.request_id, self.status)
        self.status = status
        self.finished_time = now

    def note_token_time(self, now: float) -> None:
        """After a new token (the scheduler counts it): first-token time, end of a preemption loss."""
        if self.first_token_time is None:
            self.first_token_time = now
        if self.preempted_at is not None:
            self.preemption_loss_s += now - self.preempted_at
            self.preempted_at = None
