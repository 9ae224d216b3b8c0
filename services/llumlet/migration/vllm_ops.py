"""The vLLM engine seen through `MigratableEngine` (a mixin of `VllmEngine`, so
`migration_ops_for` finds the protocol on the engine itself).

Reads come from the engine thread's last snapshot (block tables are append-only and a snapshot
reports computed tokens only after the step that wrote them returned, so what it calls full is
final). Verbs that change vLLM run on the engine thread and are waited for (at most one step):
- suspend: abort the request in vLLM with the connector holding its blocks (`vllm_connector.py`);
- resume (a failed last stage): re-add it with its output as prompt; its full blocks come back as
  local prefix-cache hits on the held ones, only the partial last block is recomputed;
- release_migrated: the connector reports the request sent, vLLM frees the held blocks;
- reserve_blocks: blocks taken out of vLLM's pool (the copier scatters straight into the KV
  cache, so source and destination share one region layout); at commit the request is added
  with its output as prompt and the connector copies the lease into the blocks vLLM allocates
  (skipping a local prefix hit), then the lease goes back to the pool.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from shared.engine_model.views import EngineError
from services.llumlet.engines.vllm_driver import VllmDriver, continuation
from services.llumlet.engines.vllm_params import check_request
from services.llumlet.engines.vllm_state import AddCommand, MigratedLoad, Tracked
from services.llumlet.migration.ops import IntakeLoad, KVRegion, LivePhase, MigrationSnapshot
from shared.messages import MigrationCommit
from shared.policy.migration import MigrationCandidate


class VllmMigrationMixin:
    """`MigratableEngine` for `VllmEngine` (uses its shared state and engine thread)."""

    def _init_migration(self) -> None:
        self._regions: tuple[KVRegion, ...] | None = None
        self._lease_sizes: dict[str, int] = {}  # destination leases not yet adopted: blocks held

    # -- both sides ----------------------------------------------------------------------------

    def kv_regions(self) -> Sequence[KVRegion]:
        if self._regions is None:
            kv_caches = self._running_driver().kv_state.kv_caches
            if not kv_caches:
                raise EngineError("vLLM registered no KV cache with Corral's connector (kv_connector off?)")
            # One tensor per layer, [num_blocks, kv_heads, block_size, 2·head_dim]: blocks on dim 0.
            self._regions = tuple(KVRegion(tensor, 0) for tensor in kv_caches.values())
        return self._regions

    def num_reserved_blocks(self) -> int:
        return sum(self._leases().values())

    def intake_load(self) -> IntakeLoad:
        """For the destination guard: the last snapshot, plus new requests queued since."""
        shared = self.shared
        with shared.lock:
            snapshot = shared.snapshot
            queued = sum(1 for c in shared.commands if isinstance(c, AddCommand) and c.load is None)
        return IntakeLoad(snapshot.num_free_blocks, self.num_blocks_total, snapshot.num_waiting_for_memory + queued)

    # -- source --------------------------------------------------------------------------------

    def migration_candidates(self) -> list[MigrationCandidate]:
        shared = self.shared
        with shared.lock:
            views, requests = shared.snapshot.migration, dict(shared.requests)
        return [
            MigrationCandidate(rid, tracked.priority, tracked.num_prompt_tokens + view.num_output_tokens)
            for rid, view in views.items()
            if (tracked := requests.get(rid)) is not None and tracked.suspended is None
            and not view.queued and view.num_output_tokens > 0
        ]

    def residence_s(self, request_id: str) -> float | None:
        """How long the request has been here since it arrived or migrated in (None: not here)."""
        with self.shared.lock:
            tracked = self.shared.requests.get(request_id)
        return None if tracked is None else time.monotonic() - tracked.placed_at

    def migration_snapshot(self, request_id: str) -> MigrationSnapshot | None:
        shared = self.shared
        with shared.lock:
            tracked = shared.requests.get(request_id)
            view = shared.snapshot.migration.get(request_id)
        if tracked is None:
            return None
        suspended = tracked.suspended
        if suspended is not None:
            return MigrationSnapshot(LivePhase.SUSPENDED, suspended.num_computed_tokens, suspended.num_preemptions,
                                     len(suspended.block_ids))
        if view is None or view.queued:  # not in vLLM yet, or waiting / preempted
            return MigrationSnapshot(LivePhase.QUEUED, 0, view.num_preemptions if view else 0, 0)
        return MigrationSnapshot(LivePhase.RUNNING, view.num_computed_tokens, view.num_preemptions, len(view.block_ids))

    def block_ids_of(self, request_id: str) -> list[int]:
        shared = self.shared
        with shared.lock:
            tracked = shared.requests.get(request_id)
            view = shared.snapshot.migration.get(request_id)
        if tracked is not None and tracked.suspended is not None:
            return list(tracked.suspended.block_ids)
        return list(view.block_ids) if view is not None else []

    def suspend(self, request_id: str) -> bool:
        return self.call_on_engine_thread(VllmDriver.suspend, request_id)

    def resume(self, request_id: str) -> bool:
        return self.call_on_engine_thread(VllmDriver.resume, request_id)

    def migration_commit(self, request_id: str, migration_id: str) -> MigrationCommit:
        with self.shared.lock:
            tracked = self.shared.requests.get(request_id)
        suspended = tracked.suspended if tracked is not None else None
        if suspended is None:
            raise EngineError(f"request {request_id} is not suspended for migration")
        return MigrationCommit(
            migration_id=migration_id,
            request=tracked.request,
            output_token_ids=list(suspended.output_token_ids),
            num_computed_tokens=suspended.num_computed_tokens,
            num_preemptions=suspended.num_preemptions,
        )

    def release_migrated(self, request_id: str) -> bool:
        return self.call_on_engine_thread(VllmDriver.release_migrated, request_id)

    # -- destination ---------------------------------------------------------------------------

    def reserve_blocks(self, lease_id: str, num_blocks: int) -> list[int] | None:
        if num_blocks == 0:  # (a last stage's pre-alloc, usually: no wait for the engine thread)
            self._leases().setdefault(lease_id, 0)
            return []
        block_ids = self.call_on_engine_thread(VllmDriver.reserve, lease_id, num_blocks)
        if block_ids is not None:
            leases = self._leases()
            leases[lease_id] = leases.get(lease_id, 0) + len(block_ids)
        return block_ids

    def release_reservation(self, lease_id: str) -> int:
        if self._leases().pop(lease_id, None) is None:
            return 0  # released already, or adopted by a committed request (its load frees it)
        return self.call_on_engine_thread(VllmDriver.release_lease, lease_id)

    def add_migrated(self, commit: MigrationCommit, lease_id: str) -> None:
        request, outputs = commit.request, list(commit.output_token_ids)
        if lease_id not in self._leases():
            raise EngineError(f"no lease {lease_id} for request {request.request_id}")
        remaining = request.sampling.max_tokens - len(outputs)
        if remaining < 1:
            raise EngineError(f"request {request.request_id} has no tokens left to generate")
        num_tokens = len(request.prompt_token_ids) + len(outputs)
        if not 0 <= commit.num_computed_tokens < num_tokens:
            raise EngineError(f"commit claims {commit.num_computed_tokens} computed of {num_tokens} tokens")
        if self._leases()[lease_id] * self.block_size < commit.num_computed_tokens:
            raise EngineError(f"lease {lease_id} holds fewer blocks than {commit.num_computed_tokens} tokens need")
        driver = self._running_driver()
        check_request(request, max_model_len=self.max_model_len, vocab_size=driver.vocab_size)
        tracked = Tracked(request.request_id, request.priority, len(request.prompt_token_ids), request=request,
                          num_delivered=len(outputs), prior_output_token_ids=outputs)
        command = continuation(tracked, request, outputs, MigratedLoad(lease_id, commit.num_computed_tokens))
        self.queue_add(tracked, command)
        del self._leases()[lease_id]  # the request owns the blocks now; the driver frees them once loaded

    def _leases(self) -> dict[str, int]:
        return self._lease_sizes
