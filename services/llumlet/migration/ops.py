"""What the migration coordinator needs from an engine (`MigratableEngine`). The simulated engine
gets that shape from `sim_ops.SimMigrationAdapter`; vLLM from `vllm_ops.VllmMigrationMixin`.

Contract an engine must keep:
- A request's block table is append-only while it runs: blocks that are full (all their token
  slots computed) never change, so they can be copied while the request keeps decoding.
- A snapshot reports `num_computed_tokens` only once their KV writes are complete (vLLM syncs on
  the sampled tokens every step, so the device work behind them is done).
- `suspend` takes a running request out of the batch keeping its blocks; a step in flight at
  that moment discards the request's work. `resume` undoes it.
- Destination blocks reserved under a lease are invisible to the scheduler until the commit;
  lease block i (in reservation order, over all stages) holds the request's block i, and
  `add_migrated` makes them the request's KV (adopting them, or copying them into its own).
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


@dataclass(frozen=True)
class KVRegion:
    """One device tensor of the KV cache (numpy array or torch tensor) whose dimension
    `block_dim` indexes blocks. A block's bytes in a fused buffer are the slice at that index,
    regions one after another; both instances of a migration have the same layout."""

    tensor: Any
    block_dim: int = 0


@dataclass(frozen=True)
class IntakeLoad:
    """What the destination guard looks at: this instance's blocks and its queue."""

    num_blocks_free: int  # reserved blocks are not free
    num_blocks_total: int
    num_waiting: int  # requests queued for memory (migrated-in ones bring their own)


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

    def suspend(self, request_id: str) -> bool: ...

    def resume(self, request_id: str) -> bool: ...

    def migration_commit(self, request_id: str, migration_id: str) -> MigrationCommit:
        """What the destination needs to continue the suspended request."""

    def release_migrated(self, request_id: str) -> bool:
        """The destination committed: free the blocks; the request produces nothing more here."""

    def residence_s(self, request_id: str) -> float | None:
        """Seconds since the request arrived here or migrated in (the anti-ping-pong guard);
        None when it is not here."""

    # -- destination ---------------------------------------------------------------------------
    def intake_load(self) -> IntakeLoad:
        """Free and total blocks and the waiting queue: may this instance take a new request?"""

    def reserve_blocks(self, lease_id: str, num_blocks: int) -> list[int] | None:
        """Hold `num_blocks` more free blocks under the lease; None (nothing taken) if short.
        (A stage's PRE-ALLOC asks for its total; a repeat with more tops the lease up.)"""

    def release_reservation(self, lease_id: str) -> int:
        """Return the lease's blocks to the free pool; idempotent."""

    def add_migrated(self, commit: MigrationCommit, lease_id: str) -> None:
        """Adopt the lease's blocks and put the request in the running batch; EngineError if
        the commit does not fit the lease."""


def migration_ops_for(engine: Any) -> MigratableEngine | None:
    """The engine's migration interface, or None when it cannot migrate (yet)."""
    if isinstance(engine, MigratableEngine):
        return engine
    if getattr(engine, "kind", None) == "sim":
        from services.llumlet.migration.sim_ops import SimMigrationAdapter

        return SimMigrationAdapter(engine)
    return None
