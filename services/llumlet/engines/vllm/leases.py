"""Destination leases on the vLLM engine thread: blocks taken out of vLLM's pool to receive an
incoming migration's KV, and their hand-over at commit. The migrated request is added to vLLM with a
`LoadPlan`, and the lease's full blocks join vLLM's prefix cache under the request's own block
hashes: its first step finds them as a local prefix hit and takes them as they are, so the
connector (`connector.py`) copies only the rest (the partial last block) into the blocks vLLM
allocated it, whatever the request's length. Then the lease goes back to the pool (the blocks the
request took stay its own). Call only on the engine thread.

A lease may start with pinned blocks (issue 18 §4): blocks of the request's prefix this engine's
prefix cache holds already (`prefix_pins.py`), referenced here so nothing evicts them; the source
never sends them. They are cached under the request's hashes already, so only the lease's blocks
after them join the cache at the add, and the request's first step takes them all as hits. The
add checks that against the hashes vLLM computes for the request; where the source named other
blocks, the lease is dropped and vLLM computes the request's KV itself (`adopt`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from services.llumlet.engines.vllm.state import MigratedLoad
from services.llumlet.migration.handover import log_first_step

log = logging.getLogger(__name__)


class DestinationLeases:
    def __init__(self, block_pool: Any, kv_state: Any, block_size: int) -> None:
        self._pool = block_pool  # vLLM's BlockPool (`probe.py`)
        self._block_size = block_size
        self._kv_state = kv_state  # the connector's MigrationState
        self._blocks: dict[str, list[Any]] = {}  # lease id → vLLM blocks taken from the pool
        self._pinned: dict[str, int] = {}  # lease id → how many of its leading blocks were cached here
        self._adopted: dict[str, str] = {}  # internal id → lease holding its migrated KV
        self._adopted_at: dict[str, tuple[float, float]] = {}  # internal id → (committed, added to vLLM)

    def pin(self, lease_id: str, cached_blocks: list[Any]) -> list[int]:
        """Hold cached blocks (a new lease's first blocks): one reference each, so they leave the
        free queue if nobody else holds them, and stay cached until the lease lets go."""
        if self._blocks.get(lease_id) or not cached_blocks:
            return []  # (a lease holding blocks already: its table cannot start with cached ones)
        self._pool.touch(cached_blocks)
        self._blocks[lease_id] = list(cached_blocks)
        self._pinned[lease_id] = len(cached_blocks)
        return [b.block_id for b in cached_blocks]

    def reserve(self, lease_id: str, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` more blocks out of the pool under the lease (None, nothing taken, if short)."""
        if num_blocks > self._pool.get_num_free_blocks():
            return None
        blocks = self._pool.get_new_blocks(num_blocks) if num_blocks else []
        self._blocks.setdefault(lease_id, []).extend(blocks)
        return [b.block_id for b in blocks]

    def release(self, lease_id: str) -> int:
        """Back to the pool; how many blocks the lease held (0: none, or released already)."""
        blocks = self._blocks.pop(lease_id, [])
        self._pinned.pop(lease_id, None)
        if blocks:
            self._pool.free_blocks(blocks)
        return len(blocks)

    def adopt(self, internal_id: str, load: MigratedLoad, vllm_request: Any) -> bool:
        """The migrated request was added to vLLM: its first step loads the lease. False: the
        lease's pinned blocks are not cached under the request's own hashes (its source named
        another prompt's blocks: a bug or a hostile peer), so its KV there is not the request's;
        the lease goes back to the pool and vLLM computes the request's KV from its tokens."""
        from services.llumlet.engines.vllm.connector import LoadPlan

        blocks = self._blocks.get(load.lease_id, [])
        num_pinned = self._pinned.get(load.lease_id, 0)
        if num_pinned and not (vllm_request is not None and self._pool.enable_caching
                               and pinned_blocks_match(self._pool, blocks[:num_pinned], vllm_request.block_hashes)):
            self.release(load.lease_id)
            return False
        self._offer_to_prefix_cache(vllm_request, blocks, load.num_tokens, num_pinned)
        self._kv_state.loads[internal_id] = LoadPlan([b.block_id for b in blocks], load.num_tokens)
        self._adopted[internal_id] = load.lease_id
        self._adopted_at[internal_id] = (load.committed_at, time.monotonic())
        return True

    def _offer_to_prefix_cache(self, vllm_request: Any, blocks: list[Any], num_tokens: int, num_pinned: int) -> None:
        """The lease's full blocks (their KV final) into the prefix cache, as the request's own
        blocks would be after a step; its first `num_pinned` are cached already. The lease keeps
        its reference until the request's first step has run, so none of them is evicted or
        handed out before that step takes them; without prefix caching (or for a request that
        skips it) the connector copies them all."""
        if vllm_request is None or not self._pool.enable_caching:
            return
        num_full = min(len(blocks), num_tokens // self._block_size, len(vllm_request.block_hashes))
        if num_full > num_pinned:
            self._pool.cache_full_blocks(vllm_request, blocks, num_pinned, num_full, self._block_size, 0)

    def is_adopted(self, internal_id: str) -> bool:
        """A migrated request whose KV still sits in its lease (it needs no blocks of the pool's to join)."""
        return internal_id in self._adopted

    def num_adopted_blocks(self, internal_id: str) -> int:
        """Blocks of the lease holding an adopted request's KV (0: none adopted)."""
        lease_id = self._adopted.get(internal_id)
        return len(self._blocks.get(lease_id, ())) if lease_id is not None else 0

    def release_loaded(self, step_started: float) -> None:
        """After a step: the leases the connector copied from go back to the pool."""
        loaded, self._kv_state.loaded = self._kv_state.loaded, []
        for internal_id in loaded:
            lease_id = self._adopted.pop(internal_id, None)
            if lease_id is not None:
                self.release(lease_id)
            self._log_load_timing(internal_id, step_started)

    def drop_adopted(self, internal_id: str) -> None:
        """The request went away before its KV was loaded: its lease goes back to the pool."""
        lease_id = self._adopted.pop(internal_id, None)
        if lease_id is None:
            return
        self._kv_state.loads.pop(internal_id, None)
        self._kv_state.pending_copies.pop(internal_id, None)
        self._adopted_at.pop(internal_id, None)
        self.release(lease_id)

    def _log_load_timing(self, internal_id: str, step_started: float) -> None:
        """Where a migrated request's first step went (the destination's share of its client stall)."""
        times = self._adopted_at.pop(internal_id, None)
        if times is None:
            return
        committed, added = times
        log_first_step(log, internal_id, committed, added, step_started, time.monotonic())


def pinned_blocks_match(block_pool: Any, pinned: list[Any], vllm_block_hashes: list[bytes]) -> bool:
    """Each pinned block is cached under the request's own hash at its index: its KV is the
    request's (the source named the blocks by the wire form of these very hashes)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from services.llumlet.engines.vllm.prefix_pins import KV_CACHE_GROUP

    cache = block_pool.cached_block_hash_to_block
    return len(pinned) <= len(vllm_block_hashes) and all(
        cache.contain(make_block_hash_with_group_id(digest, KV_CACHE_GROUP), block.block_id)
        for block, digest in zip(pinned, vllm_block_hashes))
