"""The prefix cache of the simulated engine, with vLLM v1's semantics (KVCacheManager with
`enable_prefix_caching`):

- a full block whose tokens are computed is registered under its chained block hash
  (`shared.prefix_hash`); a partial block is never cached;
- a new request reuses the longest leading run of its block hashes that is cached, at most
  up to its last token (one token is always computed, so the step samples), and skips that prefill;
- a cached block carries a reference count (the requests whose tables hold it); at zero it stays
  cached but becomes evictable, and evictable blocks are reclaimed least recently freed first
  (a request's blocks are freed tail first, so its last blocks go before its shared prefix);
- one departure: blocks that hold no cached prefix are handed out before any cached one is
  evicted (vLLM keeps both in one free queue and may evict a cached block while an uncached one
  is free), so a hit is never lost for nothing.

Only hashes and ids: the block manager owns the free list and the block tables and calls this.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Protocol


class CacheListener(Protocol):
    """Told of every hash the cache starts or stops holding (the llumlet's KV events)."""

    def stored(self, block_hashes: Iterable[int]) -> None: ...

    def removed(self, block_hashes: Iterable[int]) -> None: ...


class PrefixCache:
    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}  # block hash -> block id
        self._hash_of: dict[int, int] = {}  # block id -> block hash
        self._refs: dict[int, int] = {}  # cached block id -> tables holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs 0, least recently freed first
        self.num_query_tokens = 0  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.listener: CacheListener | None = None

    def held_hashes(self) -> list[int]:
        return list(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._block_of

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def hash_of(self, block: int) -> int | None:
        """The hash the block is cached under (None: not cached)."""
        return self._hash_of.get(block)

    def longest_hit(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached leading run of `hashes`, at most `max_blocks`."""
        hit: list[int] = []
        block_of = self._block_of
        for block_hash in hashes[:max_blocks]:
            block = block_of.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def matched_blocks(self, hashes: Sequence[int], max_blocks: int | None = None) -> int:
        """How many leading `hashes` are cached, at most `max_blocks` (what a global prefix index
        asks, and a load report's waiting prefill): `longest_hit`'s length, no list built."""
        count = 0
        block_of = self._block_of
        for block_hash in hashes if max_blocks is None else islice(hashes, max(0, max_blocks)):
            if block_hash not in block_of:
                break
            count += 1
        return count

    def count_evictable(self, blocks: Sequence[int]) -> int:
        evictable = self._evictable
        return sum(1 for b in blocks if b in evictable)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    # -- reference counts ----------------------------------------------------------------------

    def acquire(self, block: int) -> None:
        """A table takes a cached block (a hit): it is no longer evictable."""
        refs = self._refs[block]  # KeyError: only cached blocks are shared
        if refs == 0:
            del self._evictable[block]
        self._refs[block] = refs + 1

    def release(self, block: int) -> bool:
        """A table drops `block`; True if the cache keeps it (cached), False if it is plain and
        goes back to the free list."""
        refs = self._refs.get(block)
        if refs is None:
            return False
        assert refs > 0, (block, refs)
        refs -= 1
        self._refs[block] = refs
        if refs == 0:
            self._evictable[block] = None
        return True

    def register(self, block: int, block_hash: int) -> bool:
        """A table's block is full and computed: cache it under `block_hash`, unless another block
        already holds that prefix (then this one stays plain; vLLM caches it as a second copy,
        which may outlive the first's eviction: a small difference, not modelled). Held by one table."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._refs[block] = 1
        if self.listener is not None:
            self.listener.stored((block_hash,))
        return True

    def evict(self) -> int:
        """Reclaim the least recently freed evictable block; its hash is forgotten."""
        block, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        if self.listener is not None:
            self.listener.removed((block_hash,))
        del self._refs[block]
        self.num_evictions += 1
        return block

    def evictable_blocks(self) -> list[int]:
        return list(self._evictable)

    def check_invariants(self, tables: Sequence[Sequence[int]]) -> None:
        assert len(self._block_of) == len(self._hash_of) == len(self._refs)
        for block_hash, block in self._block_of.items():
            assert self._hash_of[block] == block_hash
        held: dict[int, int] = {}
        for table in tables:
            for block in table:
                if block in self._hash_of:
                    held[block] = held.get(block, 0) + 1
        for block, refs in self._refs.items():
            assert refs == held.get(block, 0), (block, refs, held.get(block, 0))
            assert (refs == 0) == (block in self._evictable), (block, refs)
