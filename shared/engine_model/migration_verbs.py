"""The local scheduler's migration verbs (Llumnix §4.2), as the engines call them: the source takes
a request out of the batch for its last stage and gives it back or lets it go; the destination
reserves a lease (never out of blocks admitted prompts are owed), pins the cached blocks of the
request's prefix, and adopts the lease as the request's block table at the commit.

A mixin of `SimScheduler` (it reads the scheduler's queues and block manager); kept apart so the
scheduling rules and the migration contract each have one home."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.engine_model.block_manager import blocks_for_tokens
from shared.engine_model.request import RequestStatus, SimRequest
from shared.engine_model.views import EngineError

if TYPE_CHECKING:
    from shared.engine_model.scheduler import SimScheduler

_RUNNING = RequestStatus.RUNNING


class MigrationVerbs:
    def suspend(self: SimScheduler, request_id: str) -> bool:
        """Take a running request out of the batch (last migration stage); its blocks stay.
        False if it is not running (finished, preempted or aborted meanwhile)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not _RUNNING:
            return False
        self.running.remove(request)
        request.suspend()
        self.suspended[request_id] = request
        return True

    def resume(self: SimScheduler, request_id: str) -> bool:
        """Back into the batch after an aborted migration; False if it is not suspended."""
        request = self.suspended.pop(request_id, None)
        if request is None:
            return False
        request.resume()
        self.running.append(request)
        return True

    def release_migrated(self: SimScheduler, request_id: str, now: float = 0.0) -> bool:
        """The destination committed: free the blocks here; the request produces nothing more."""
        request = self.suspended.pop(request_id, None)
        if request is None:
            return False
        self.block_manager.free(request_id)
        self._finish(request, RequestStatus.FINISHED_MIGRATED, now)
        return True

    def add_migrated(self: SimScheduler, request: SimRequest, lease_id: str) -> bool:
        """Destination commit: the lease's reserved blocks become the request's block table and
        it joins the running batch with `num_computed_tokens` already computed. False: the
        lease's pinned blocks are not cached under the request's own prefix hashes (its source
        named another prompt's blocks: a bug or a hostile peer); as vLLM's destination does
        (`DestinationLeases.adopt`), the lease goes back and the request queues to compute its
        KV from its tokens, its output so far kept."""
        self._validate(request)
        request.set_stop(self.max_seq_len)
        reserved = len(self.block_manager.reserved_blocks(lease_id))
        if not 0 < request.num_computed_tokens < request.num_tokens <= self.max_seq_len:
            raise EngineError(f"migrated request {request.request_id}: inconsistent token counts")
        if request.num_output_tokens >= request.stop_at_output:
            raise EngineError(f"migrated request {request.request_id} has nothing left to generate")
        if reserved < blocks_for_tokens(request.num_computed_tokens, self.block_size):
            raise EngineError(f"lease {lease_id} holds {reserved} blocks, too few for request {request.request_id}")
        if not self._pins_are_its_prefix(lease_id, request):
            self.block_manager.release(lease_id)
            request.num_computed_tokens = 0
            self.requests[request.request_id] = request
            self.counts.count_live(request, +1)
            self._push_waiting(request, front=False)
            return False
        self.block_manager.adopt(lease_id, request.request_id, group=request.priority)
        request.start_migrated_in()
        self.requests[request.request_id] = request
        self.counts.count_live(request, +1)
        self.running.append(request)
        return True

    def _pins_are_its_prefix(self: SimScheduler, lease_id: str, request: SimRequest) -> bool:
        pinned = self.block_manager.pinned_of(lease_id)
        if not pinned:
            return True
        cache, hashes = self.prefix_cache, request.block_hashes
        return cache is not None and len(pinned) <= len(hashes) and all(
            cache.hash_of(block) == block_hash for block, block_hash in zip(pinned, hashes))

    def block_ids_of(self: SimScheduler, request_id: str) -> list[int]:
        return self.block_manager.blocks_of(request_id)

    def reserve(self: SimScheduler, lease_id: str, num_blocks: int) -> list[int] | None:
        """Blocks for an incoming migration; None when taking them would leave fewer free blocks
        than admitted prompts still have to claim (the lease would preempt them)."""
        if num_blocks > self.block_manager.num_free - self.committed_blocks():
            return None
        return self.block_manager.reserve(lease_id, num_blocks)

    def pin_cached_prefix(self: SimScheduler, lease_id: str, block_hashes: Sequence[int], max_blocks: int) -> int:
        """An incoming migration binds to the blocks of the request's leading prefix this engine's
        cache holds (at most `max_blocks`, the source's full computed blocks): they need no copy.
        Call before the lease reserves anything. Returns how many leading blocks are pinned;
        0 without a prefix cache. A cached block nobody holds leaves the free pool when pinned,
        so the hit is cut short where that would take blocks admitted prompts are owed."""
        cache = self.prefix_cache
        if cache is None or not block_hashes or max_blocks < 1:
            return 0
        hit = cache.longest_hit(block_hashes, max_blocks)
        spare = self.block_manager.num_free - self.committed_blocks()
        while hit and cache.count_evictable(hit) > spare:
            hit.pop()
        self.block_manager.pin_cached(lease_id, hit)
        return len(hit)

    def release(self: SimScheduler, lease_id: str) -> int:
        return self.block_manager.release(lease_id)
