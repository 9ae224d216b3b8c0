"""What the migration coordinator needs from an engine (`MigratableEngine`): the engine-neutral
contract. Each engine implements it in its own package (`engines/sim/migration.py`,
`engines/vllm/migration.py`) and hands it out from `Engine.migration_ops()`; nothing here knows
an engine.

Contract an engine must keep:
- A request's block table is append-only while it runs: blocks that are full (all their token
  slots computed) never change, so they can be copied while the request keeps decoding.
- A snapshot reports `num_computed_tokens` only once their KV writes are complete (vLLM syncs on
  the sampled tokens every step, so the device work behind them is done).
- `suspend` takes a running request out of the batch keeping its blocks, after the step in
  flight (whose token it keeps) and before the next. `resume` undoes it.
- Destination blocks reserved under a lease are invisible to the scheduler until the commit;
  lease block i (in reservation order, over all stages) holds the request's block i, and
  `add_migrated` makes them the request's KV (adopting them, or copying them into its own).
- Verbs that may wait for the engine (a step in progress on vLLM's engine thread) are coroutines,
  so the llumlet's event loop keeps serving meanwhile; the coordinator re-checks after them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shared.messages import MigrationCommit
from shared.policy.migration import MigrationCandidate


class LivePhase(enum.Enum):
    QUEUED = "queued"  # waiting or preempted: no KV
    RUNNING = "running"
    SUSPENDED = "suspended"  # out of the batch for the last migration stage, blocks kept


@dataclass(frozen=True)
class MigrationSnapshot:
    """Where a live request stands; the coordinator re-reads it after every await."""

    phase: LivePhase
    num_computed_tokens: int
    num_preemptions: int
    num_blocks: int
    max_num_tokens: int = 0  # the longest it can grow: prompt + max_tokens (0: not known)


@dataclass(frozen=True)
class KVRegion:
    """One device tensor of the KV cache (numpy array or torch tensor) whose dimension
    `block_dim` indexes blocks. A block's bytes in a fused buffer are the slice at that index,
    regions one after another; both instances of a migration have the same layout.
    `token_dim` indexes a block's token slots (None: not known, so only whole blocks move)."""

    tensor: Any
    block_dim: int = 0
    token_dim: int | None = None


@dataclass(frozen=True)
class IntakeLoad:
    """What the destination guard looks at: this instance's blocks and its queue."""

    num_blocks_free: int  # reserved blocks are not free
    num_blocks_total: int
    num_waiting: int  # requests queued for memory (migrated-in ones bring their own)
    num_blocks_committed: int = 0  # free blocks admitted prompts still have to claim


@runtime_checkable
class MigratableEngine(Protocol):
    block_size: int

    # -- both sides ----------------------------------------------------------------------------
    def kv_regions(self) -> Sequence[KVRegion]:
        """The KV cache tensors the copier gathers from and scatters into (empty: no bytes).
        Asked once, after `start()`."""

    def num_reserved_blocks(self) -> int: ...

    # -- source --------------------------------------------------------------------------------
    def migration_candidates(self) -> list[MigrationCandidate]:
        """Running requests in their decode phase (at least one token out)."""

    def migration_snapshot(self, request_id: str) -> MigrationSnapshot | None:
        """None when the request is not live here (finished, aborted, migrated away)."""

    def block_ids_of(self, request_id: str) -> list[int]: ...

    def prefix_block_hashes(self, request_id: str) -> Sequence[int]:
        """The request's leading full-block hashes in wire form (shared.prefix_hash: the prompt's,
        and on vLLM its output's full blocks too) for a destination to bind to its cached
        prefix; empty when the engine does not hash them."""

    async def suspend(self, request_id: str) -> bool:
        """Out of the batch, blocks kept; False if it was not running (the request left)."""

    async def resume(self, request_id: str) -> bool:
        """Back into the batch after a failed last stage; False if it was not suspended."""

    def migration_commit(self, request_id: str, migration_id: str) -> MigrationCommit:
        """What the destination needs to continue the suspended request."""

    async def release_migrated(self, request_id: str) -> bool:
        """The destination committed: free the blocks; the request produces nothing more here."""

    def residence_s(self, request_id: str) -> float | None:
        """Seconds since the request arrived here or migrated in (the anti-ping-pong guard);
        None when it is not here."""

    # -- destination ---------------------------------------------------------------------------
    def intake_load(self) -> IntakeLoad:
        """Free and total blocks and the waiting queue: may this instance take a new request?"""

    async def reserve_blocks(self, lease_id: str, num_blocks: int) -> list[int] | None:
        """Hold `num_blocks` more free blocks under the lease; None (nothing taken) if short.
        (A stage's PRE-ALLOC asks for its total; a repeat with more tops the lease up.)"""

    async def pin_cached_prefix(self, lease_id: str, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Before the lease reserves anything: hold the cached blocks of the longest leading run
        of `block_hashes` (at most `max_blocks`) under the lease; they lead its table at the
        commit and need no copy. Their ids; empty when nothing is cached (or not supported).
        `release_reservation` gives them back."""

    def release_reservation(self, lease_id: str) -> int:
        """Return the lease's blocks to the free pool (the engine may do it a moment later: no
        wait); how many it held. Idempotent."""

    def add_migrated(self, commit: MigrationCommit, lease_id: str) -> None:
        """Adopt the lease's blocks and put the request in the running batch; EngineError if
        the commit does not fit the lease."""

