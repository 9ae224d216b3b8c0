"""The vLLM destination's side of a cache-aware migration (issue 18 §4): which leading blocks of
a moving request its prefix cache holds already, found from the wire hashes the source names.

vLLM keys its prefix cache by the full 32-byte digest (`sha256_cbor`: the gateway's chain); the
wire carries only its 63-bit form (`shared.prefix_hash.wire_hash`), which cannot be turned back.
`CachedDigests` keeps wire hash -> digest for what the cache holds, fed from vLLM's own KV events
with raw digests (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, set by `startup.py` before the
engine is built): a stored block adds its digest, a removed one drops it unless another block
still caches the same digest, a cleared cache empties it. A digest found here is then looked up in the
block pool itself, so a stale entry costs a miss, never a wrong block. Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

from shared.prefix_hash import wire_hash

log = logging.getLogger(__name__)

KV_CACHE_GROUP = 0  # a plain decoder has one KV cache group (`SchedulerProbe.num_blocks_of` too)


class CachedDigests:
    def __init__(self, block_pool: Any) -> None:
        self._pool = block_pool  # vLLM's BlockPool
        self._by_wire: dict[int, bytes] = {}
        self._digests: set[bytes] = set()  # the same digests, for a count without the pool's lookups
        self._warned = False

    def __len__(self) -> int:
        return len(self._by_wire)

    def stored(self, block_hashes: Iterable[int | bytes]) -> None:
        for block_hash in block_hashes:
            if isinstance(block_hash, bytes):
                self._by_wire[wire_hash(block_hash)] = block_hash
                self._digests.add(block_hash)
            elif not self._warned:  # vLLM sent integer hashes: the digests are not to be had
                self._warned = True
                log.warning("vLLM's KV events carry integer block hashes: migrations into this instance "
                            "copy every block (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES was read before it was set)")

    def removed(self, block_hashes: Iterable[int | bytes]) -> None:
        for block_hash in block_hashes:
            if isinstance(block_hash, bytes) and not self.still_cached(block_hash):
                self._by_wire.pop(wire_hash(block_hash), None)
                self._digests.discard(block_hash)

    def still_cached(self, block_hash: int | bytes) -> bool:
        """Whether the pool still caches this digest (vLLM keeps duplicate blocks of one digest,
        so a removal event may name one another block caches yet). False for an integer hash."""
        return isinstance(block_hash, bytes) and self._cached_block(block_hash) is not None

    def cleared(self) -> None:
        self._by_wire.clear()
        self._digests.clear()

    def cached_prefix(self, wire_hashes: Sequence[int], max_blocks: int) -> list[Any]:
        """The cached blocks (vLLM KVCacheBlocks) of the longest leading run of `wire_hashes`,
        at most `max_blocks` of them; none referenced here."""
        blocks: list[Any] = []
        for wire in wire_hashes[:max(0, max_blocks)]:
            digest = self._by_wire.get(wire)
            block = None if digest is None else self._cached_block(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_leading_cached(self, digests: Sequence[bytes], max_blocks: int) -> int:
        """How many of a request's leading block digests (vLLM's `Request.block_hashes`) the
        prefix cache holds, as its KV events told, at most `max_blocks`: the hit vLLM's
        admission would find, without asking its KV cache manager (whose lookup counts in vLLM's
        prefix-cache metrics) or its block pool (a lookup builds a key: per waiting request and
        block at every step, that cost ~1 us each). A set lookup per block."""
        held = self._digests
        count = 0
        for digest in islice(digests, max(0, max_blocks)):
            if digest not in held:
                break
            count += 1
        return count

    def _cached_block(self, digest: bytes) -> Any | None:
        found = self._pool.get_cached_block(digest, [KV_CACHE_GROUP])
        return None if found is None else found[0]


def wire_hashes_of(vllm_block_hashes: Sequence[bytes], known: list[int]) -> list[int]:
    """A request's full-block hashes in wire form, extending `known` (those of its first blocks,
    computed before) in place: vLLM's list only grows while the request runs."""
    for digest in vllm_block_hashes[len(known):]:
        known.append(wire_hash(digest))
    return known
