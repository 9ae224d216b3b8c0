"""The vLLM engine's migration verbs, as `MigratableEngine` (`migration/ops.py`).

`VllmMigration` is composed over the engine and reaches it only through `VllmEngineParts`.
Reads come from the engine thread's last snapshot (block tables are append-only and a snapshot
reports computed tokens only after the step that wrote them returned, so what it calls full is
final). Verbs that change vLLM run on the engine thread; the coroutine awaits them there (at most
the step in progress), so the llumlet's event loop keeps serving meanwhile:
- suspend: abort the request in vLLM with the connector holding its blocks (`connector.py`);
- resume (a failed last stage): re-add it with its output as prompt; its full blocks come back as
  local prefix-cache hits on the held ones, only the partial last block is recomputed;
- release_migrated: the connector reports the request sent, vLLM frees the held blocks;
- reserve_blocks: blocks taken out of vLLM's pool (the copier scatters straight into the KV
  cache, so source and destination share one region layout); at commit the request is added
  with its output as prompt, the lease's full blocks join vLLM's prefix cache under its block
  hashes (its first step takes them as a local hit), the connector copies the rest (the partial
  last block) into the blocks vLLM allocates, then the lease goes back to the pool (`leases.py`).
- cache-aware (issue 18 §4, prefix caching on): the source names the request's full blocks by
  vLLM's own block hashes in wire form; the destination pins the ones its prefix cache holds
  (`prefix_pins.py`) as the lease's first blocks, and the source never sends those.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from services.llumlet.engines.vllm.driver import VllmDriver, continuation
from services.llumlet.engines.vllm.params import check_request
from services.llumlet.engines.vllm.prefix_pins import wire_hashes_of
from services.llumlet.engines.vllm.state import AddCommand, MigratedLoad, SharedState, Tracked, TrackedStatus
from services.llumlet.migration.ops import IntakeLoad, KVRegion, LivePhase, MigrationSnapshot
from shared.engine_model.views import EngineError
from shared.messages import MigrationCommit
from shared.policy.migration import MigrationCandidate, is_migratable

log = logging.getLogger(__name__)

T = TypeVar("T")


class VllmEngineParts(Protocol):
    """What the migration verbs use of the vLLM engine (`engine.VllmEngine`)."""

    block_size: int
    num_blocks_total: int
    max_model_len: int

    @property
    def shared(self) -> SharedState: ...

    def running_driver(self) -> VllmDriver:
        """EngineError when the engine is not running."""

    def on_engine_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Submit `fn(driver, *args)` to the engine thread (it runs after the step in progress);
        the future is bound to the event loop."""

    def queue_add(self, tracked: Tracked, command: AddCommand) -> None: ...


class VllmMigration:
    """`MigratableEngine` for the vLLM engine: one per engine (`VllmEngine.migration_ops`)."""

    def __init__(self, engine: VllmEngineParts) -> None:
        self.engine = engine
        self._regions: tuple[KVRegion, ...] | None = None
        # Destination leases not yet adopted: blocks held. Written where the blocks move (the
        # engine thread for reservations) under the shared lock, so a reservation whose waiter
        # was cancelled is still counted, and released with its lease.
        self._lease_sizes: dict[str, int] = {}

    @property
    def block_size(self) -> int:  # (known once the engine started)
        return self.engine.block_size

    @property
    def _shared(self) -> SharedState:
        return self.engine.shared

    # -- both sides ----------------------------------------------------------------------------

    def kv_regions(self) -> Sequence[KVRegion]:
        if self._regions is None:
            kv_caches = self.engine.running_driver().kv_state.kv_caches
            if not kv_caches:
                raise EngineError("vLLM registered no KV cache with Corral's connector (kv_connector off?)")
            # One tensor per layer, [num_blocks, kv_heads, block_size, 2·head_dim]: blocks on dim 0.
            # Whole blocks only (no token dim): inside a block, CPU attention stores keys
            # transposed ([head_dim, block_size]; an ISA kernel may pack it further), so one token's key
            # spans the block and its slots are no tensor dimension (tests/vllm/test_vllm_kv_layout.py).
            self._regions = tuple(KVRegion(tensor, 0) for tensor in kv_caches.values())
        return self._regions

    def num_reserved_blocks(self) -> int:
        with self._shared.lock:
            return sum(self._lease_sizes.values())

    def intake_load(self) -> IntakeLoad:
        """For the destination guard: the last snapshot, plus new requests queued since."""
        shared = self._shared
        with shared.lock:
            snapshot = shared.snapshot
            queued = sum(1 for c in shared.commands if isinstance(c, AddCommand) and c.load is None)
        return IntakeLoad(snapshot.num_free_blocks, self.engine.num_blocks_total,
                          snapshot.num_waiting_for_memory + queued)

    # -- source --------------------------------------------------------------------------------

    def migration_candidates(self) -> list[MigrationCandidate]:
        shared = self._shared
        with shared.lock:
            views, requests = shared.snapshot.migration, dict(shared.requests)
        return [
            MigrationCandidate(rid, tracked.priority, tracked.num_prompt_tokens + view.num_output_tokens)
            for rid, view in views.items()
            if (tracked := requests.get(rid)) is not None and tracked.status is TrackedStatus.IN_VLLM
            and not view.queued and is_migratable(
                num_output_tokens=view.num_output_tokens, num_computed_tokens=view.num_computed_tokens,
                num_tokens=tracked.num_prompt_tokens + view.num_output_tokens, recovering=False)
        ]

    def residence_s(self, request_id: str) -> float | None:
        """How long the request has been here since it arrived or migrated in (None: not here)."""
        with self._shared.lock:
            tracked = self._shared.requests.get(request_id)
        return None if tracked is None else time.monotonic() - tracked.placed_at

    def migration_snapshot(self, request_id: str) -> MigrationSnapshot | None:
        shared = self._shared
        with shared.lock:
            tracked = shared.requests.get(request_id)
            view = shared.snapshot.migration.get(request_id)
            suspended = tracked.suspended if tracked is not None else None
        if tracked is None:
            return None
        order = tracked.request  # (a resumed request's prompt holds its output so far, its max_tokens the rest)
        most = len(order.prompt_token_ids) + order.sampling.max_tokens if order is not None else 0
        if suspended is not None:
            return MigrationSnapshot(LivePhase.SUSPENDED, suspended.num_computed_tokens, suspended.num_preemptions,
                                     len(suspended.block_ids), most)
        if view is None or view.queued:  # not in vLLM yet, or waiting / preempted
            return MigrationSnapshot(LivePhase.QUEUED, 0, view.num_preemptions if view else 0, 0, most)
        return MigrationSnapshot(LivePhase.RUNNING, view.num_computed_tokens, view.num_preemptions, len(view.block_ids),
                                 most)

    def prefix_block_hashes(self, request_id: str) -> Sequence[int]:
        """vLLM's hashes of the request's full blocks (prompt and output so far: a destination
        holding any of them needs no copy), in wire form. vLLM hashes blocks with prefix caching
        off too (Corral's KV connector is on), so a source without a cache still names them."""
        with self._shared.lock:
            tracked = self._shared.requests.get(request_id)
        vreq = tracked.vllm_request if tracked is not None else None
        if vreq is None:
            return ()
        return wire_hashes_of(vreq.block_hashes, tracked.wire_hashes)

    def block_ids_of(self, request_id: str) -> list[int]:
        shared = self._shared
        with shared.lock:
            tracked = shared.requests.get(request_id)
            view = shared.snapshot.migration.get(request_id)
            suspended = tracked.suspended if tracked is not None else None
        if suspended is not None:
            return list(suspended.block_ids)
        return list(view.block_ids) if view is not None else []

    async def suspend(self, request_id: str) -> bool:
        return await self.engine.on_engine_thread(VllmDriver.suspend, request_id)

    async def resume(self, request_id: str) -> bool:
        return await self.engine.on_engine_thread(VllmDriver.resume, request_id)

    def migration_commit(self, request_id: str, migration_id: str) -> MigrationCommit:
        with self._shared.lock:
            tracked = self._shared.requests.get(request_id)
            suspended = tracked.suspended if tracked is not None else None
        if suspended is None:
            raise EngineError(f"request {request_id} is not suspended for migration")
        return MigrationCommit(
            migration_id=migration_id,
            request=tracked.request,
            output_token_ids=list(suspended.output_token_ids),
            num_computed_tokens=suspended.num_computed_tokens,
            num_preemptions=tracked.prior_preemptions + suspended.num_preemptions,
            tail_logprobs=suspended.tail_logprobs,
        )

    async def release_migrated(self, request_id: str) -> bool:
        return await self.engine.on_engine_thread(VllmDriver.release_migrated, request_id)

    # -- destination ---------------------------------------------------------------------------

    async def pin_cached_prefix(self, lease_id: str, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        digests = self.engine.running_driver().cached_digests
        if digests is None or len(digests) == 0 or not block_hashes or max_blocks < 1:
            return []  # (prefix caching off, or nothing cached: no wait for the engine thread)
        return await self.engine.on_engine_thread(self._pin, lease_id, list(block_hashes), max_blocks)

    def _pin(self, driver: VllmDriver, lease_id: str, block_hashes: list[int], max_blocks: int) -> list[int]:
        """On the engine thread (counted with the lease like a reservation)."""
        block_ids = driver.pin_cached_prefix(lease_id, block_hashes, max_blocks)
        if block_ids:
            with self._shared.lock:
                self._lease_sizes[lease_id] = self._lease_sizes.get(lease_id, 0) + len(block_ids)
        return block_ids

    async def reserve_blocks(self, lease_id: str, num_blocks: int) -> list[int] | None:
        if num_blocks == 0:  # (a last stage's pre-alloc, usually: no wait for the engine thread)
            with self._shared.lock:
                self._lease_sizes.setdefault(lease_id, 0)
            return []
        return await self.engine.on_engine_thread(self._reserve, lease_id, num_blocks)

    def _reserve(self, driver: VllmDriver, lease_id: str, num_blocks: int) -> list[int] | None:
        """On the engine thread."""
        block_ids = driver.reserve(lease_id, num_blocks)
        if block_ids is not None:
            with self._shared.lock:
                self._lease_sizes[lease_id] = self._lease_sizes.get(lease_id, 0) + len(block_ids)
        return block_ids

    def release_reservation(self, lease_id: str) -> int:
        """No wait: the engine thread frees the blocks after the step in progress (in order
        behind any reservation queued before)."""
        with self._shared.lock:
            size = self._lease_sizes.pop(lease_id, None)
        if size is None:
            return 0  # released already, or adopted by a committed request (its load frees it)
        if size:
            self.engine.on_engine_thread(VllmDriver.release_lease, lease_id).add_done_callback(_log_failure)
        return size

    def add_migrated(self, commit: MigrationCommit, lease_id: str) -> None:
        request, outputs = commit.request, list(commit.output_token_ids)
        with self._shared.lock:
            lease_blocks = self._lease_sizes.get(lease_id)
        if lease_blocks is None:
            raise EngineError(f"no lease {lease_id} for request {request.request_id}")
        remaining = request.sampling.max_tokens - len(outputs)
        if remaining < 1:
            raise EngineError(f"request {request.request_id} has no tokens left to generate")
        num_tokens = len(request.prompt_token_ids) + len(outputs)
        if not 0 <= commit.num_computed_tokens < num_tokens:
            raise EngineError(f"commit claims {commit.num_computed_tokens} computed of {num_tokens} tokens")
        if lease_blocks * self.block_size < commit.num_computed_tokens:
            raise EngineError(f"lease {lease_id} holds fewer blocks than {commit.num_computed_tokens} tokens need")
        driver = self.engine.running_driver()
        check_request(request, max_model_len=self.engine.max_model_len, vocab_size=driver.vocab_size)
        tracked = Tracked(request.request_id, request.priority, len(request.prompt_token_ids), request=request,
                          num_delivered=len(outputs), prior_output_token_ids=outputs,
                          prior_preemptions=commit.num_preemptions)
        command = continuation(tracked, request, outputs,
                               MigratedLoad(lease_id, commit.num_computed_tokens, num_blocks=lease_blocks))
        self.engine.queue_add(tracked, command)
        with self._shared.lock:  # the request owns the blocks now; the driver frees them once loaded
            del self._lease_sizes[lease_id]


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("releasing a lease failed", exc_info=future.exception())
