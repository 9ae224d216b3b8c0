"""What the event loop and the vLLM engine thread share: requests, queued commands, outputs, snapshots.

The event loop writes commands and reads snapshots; the engine thread applies commands, steps vLLM
and writes outputs and snapshots. Everything in `SharedState` is read and written under its lock.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shared.engine_model.views import RequestView, StepOutput
from shared.messages import TokenLogprob


class TrackedStatus(enum.Enum):
    """Where one of our requests is, as the adapter sees it (vLLM's own status says more while
    it is IN_VLLM: waiting, running, preempted)."""

    QUEUED = "queued"  # its add command waits for the engine thread
    IN_VLLM = "in_vllm"  # added to vLLM: waiting, running or preempted there
    SUSPENDED = "suspended"  # aborted in vLLM with its blocks held: a migration's last stage
    GONE = "gone"  # finished, failed, aborted or migrated away: nothing more here

    @property
    def next(self) -> frozenset[TrackedStatus]:
        return _NEXT[self]


_NEXT = {
    TrackedStatus.QUEUED: frozenset({TrackedStatus.IN_VLLM, TrackedStatus.GONE}),
    TrackedStatus.IN_VLLM: frozenset({TrackedStatus.SUSPENDED, TrackedStatus.GONE}),
    # (resumed after a failed last stage: re-added with its output as prompt)
    TrackedStatus.SUSPENDED: frozenset({TrackedStatus.QUEUED, TrackedStatus.GONE}),
    TrackedStatus.GONE: frozenset(),
}


@dataclass(eq=False)
class Tracked:
    """One of our requests, from `add_request` until it finishes or is aborted.

    The fields after `num_prompt_tokens` are touched only on the engine thread (`status` and
    `suspended` also under the shared lock, since the event loop reads them).
    """

    request_id: str
    priority: int
    num_prompt_tokens: int
    internal_id: str | None = None  # vLLM's id for it: ours plus a random suffix
    vllm_request: Any = None  # vLLM's Request object; it keeps its counters after finishing
    num_delivered: int = 0  # output tokens returned so far: the next output's start index
    num_preemptions_seen: int = 0
    request: Any = None  # the GenerateRequest (shared.messages), for migration commits
    # Tokens generated before this engine took the request (a migrated request, or one resumed
    # after a failed migration): vLLM sees them as prompt.
    prior_output_token_ids: list[int] = field(default_factory=list)
    # The last step's logprobs (start index, one per token), when the request asked for them: a
    # migration's commit carries them (the gateway may not have that step's chunk yet).
    last_logprobs: tuple[int, list[TokenLogprob]] | None = None
    # Preemptions before this vLLM request (on the instances it left, or before a failed
    # migration re-added it): the request's count goes on from there.
    prior_preemptions: int = 0
    status: TrackedStatus = TrackedStatus.QUEUED
    suspended: Suspended | None = None  # what it was when suspended (status SUSPENDED only)
    placed_at: float = field(default_factory=time.monotonic)  # arrived or migrated in here
    # Its vLLM block hashes in wire form, as far as the event loop asked (`prefix_pins.wire_hashes_of`).
    wire_hashes: list[int] = field(default_factory=list)

    def move(self, to: TrackedStatus, suspended: Suspended | None = None) -> None:
        """The one way status changes: asserts the transition (and a record with SUSPENDED)."""
        assert to in self.status.next, f"{self.request_id}: {self.status.value} -> {to.value}"
        assert (to is TrackedStatus.SUSPENDED) == (suspended is not None), (to, suspended)
        self.status, self.suspended = to, suspended

    @property
    def num_preemptions(self) -> int:
        return self.vllm_request.num_preemptions if self.vllm_request is not None else 0


@dataclass(frozen=True)
class Suspended:
    """A request aborted in vLLM with its blocks held (migration's last stage): what it was."""

    internal_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_preemptions: int
    output_token_ids: tuple[int, ...]  # all of them, since the request's start
    tail_logprobs: list[TokenLogprob] | None = None  # of the last of them (`Tracked.last_logprobs`)


@dataclass(frozen=True)
class MigratedLoad:
    """A migrated request's KV: in the lease's blocks, covering its first `num_tokens` tokens."""

    lease_id: str
    num_tokens: int
    committed_at: float = field(default_factory=time.monotonic)  # (for the load's timing log)
    num_blocks: int = 0  # the lease's blocks (for the load report until vLLM has the request)


@dataclass(frozen=True)
class AddCommand:
    tracked: Tracked
    prompt_token_ids: list[int]
    sampling_params: Any  # vllm.SamplingParams, validated on the event loop
    load: MigratedLoad | None = None


@dataclass(frozen=True)
class AbortCommand:
    tracked: Tracked


@dataclass(frozen=True)
class MigrationView:
    """One live request as migration sees it, at the same moment as the snapshot."""

    queued: bool
    num_computed_tokens: int  # their KV writes are done (the step that computed them returned)
    num_preemptions: int
    block_ids: tuple[int, ...]
    num_output_tokens: int


@dataclass(frozen=True)
class Snapshot:
    """The scheduler as the engine thread last saw it (after a step or a batch of commands)."""

    waiting: tuple[RequestView, ...] = ()  # in the order vLLM will schedule them
    running: tuple[RequestView, ...] = ()
    num_free_blocks: int = 0
    migration: dict[str, MigrationView] = field(default_factory=dict)  # by our request id
    # Waiting requests that need blocks from the pool, i.e. not migrated-in ones whose KV is
    # still in their lease (they join the batch at the next step).
    num_waiting_for_memory: int = 0
    # What those waiting requests will prefill, each less its leading blocks cached now (None:
    # prefix caching off).
    waiting_prefill_tokens: int | None = None


@dataclass
class SharedState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: dict[str, Tracked] = field(default_factory=dict)  # live or queued, by our id
    commands: list[AddCommand | AbortCommand] = field(default_factory=list)  # in arrival order
    outbox: list[StepOutput] = field(default_factory=list)  # produced, not yet returned by step()
    snapshot: Snapshot = field(default_factory=Snapshot)
    num_preemptions_total: int = 0

    def is_live(self, tracked: Tracked) -> bool:
        """Still ours (not aborted, not finished). Caller holds the lock."""
        return self.requests.get(tracked.request_id) is tracked

    def take_commands(self) -> list[AddCommand | AbortCommand]:
        with self.lock:
            commands, self.commands = self.commands, []
        return commands

    def take_outbox(self) -> list[StepOutput]:
        with self.lock:
            outputs, self.outbox = self.outbox, []
        return outputs
