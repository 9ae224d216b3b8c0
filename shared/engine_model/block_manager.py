"""Paged KV block accounting: which block ids are free, owned by a request, or reserved.

Only counts and ids; the bytes (when there are any) live in `kv_pool.KVPool`. Reservations hold
blocks for an incoming migration under a lease id until it commits (`adopt`) or is dropped
(`release`); a lease may also pin the cached blocks of the request's prefix (`pin_cached`), which
need no copy and join its table at the commit. With a `PrefixCache`, full computed blocks may be cached under their prefix hash
and shared by several tables; cached blocks nobody holds count as free and are evicted (least
recently freed first) only when no plain free block is left. Each owner belongs to a group (the scheduler uses its priority) whose block total is
kept up to date, so a load report never walks the block tables.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine_model.prefix_cache import PrefixCache


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: freed blocks are reused first, like vLLM's free block queue for recent frees.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._reserved: dict[str, list[int]] = {}
        self._pinned: dict[str, list[int]] = {}  # lease -> cached blocks of the request's prefix it holds
        self._num_reserved = 0
        self._group_of: dict[str, int] = {}
        self._group_blocks: dict[int, int] = {}  # group -> blocks its owners hold (0s dropped)
        self.cache: PrefixCache | None = PrefixCache() if prefix_caching else None
        self._num_hashed: dict[str, int] = {}  # owner -> leading table blocks already offered to the cache

    # -- counts --------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: plain free ones and cached ones nobody holds."""
        cache = self.cache
        return len(self._free) if cache is None else len(self._free) + cache.num_evictable

    @property
    def num_reserved(self) -> int:
        return self._num_reserved

    @property
    def num_used(self) -> int:
        """Physical blocks owned by requests or pinned by incoming migrations (reservations not
        included; a shared cached block counts once, while `group_blocks` counts it for each owner)."""
        return self.num_blocks - self.num_free - self._num_reserved

    def has_owner(self, owner: str) -> bool:
        return owner in self._tables

    def blocks_of(self, owner: str) -> list[int]:
        return list(self._tables[owner])

    def num_blocks_of(self, owner: str) -> int:
        table = self._tables.get(owner)
        return 0 if table is None else len(table)

    def group_blocks(self) -> dict[int, int]:
        """Blocks held per owner group (groups holding none are left out); do not modify."""
        return self._group_blocks

    # -- allocation ----------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, owner: str, num_blocks: int, group: int = 0, cached: Sequence[int] = ()) -> list[int]:
        """A table of `num_blocks` blocks whose leading ones are the prefix-cache hits `cached`."""
        assert owner not in self._tables, f"double allocate for {owner}"
        assert len(cached) <= num_blocks, (len(cached), num_blocks)
        if cached:
            cache = self.cache
            assert cache is not None
            for block in cached:
                cache.acquire(block)
            self._num_hashed[owner] = len(cached)
        assert num_blocks - len(cached) <= self.num_free, (num_blocks, len(cached), self.num_free)
        table = list(cached) + self._take(num_blocks - len(cached))
        self._tables[owner] = table
        self._group_of[owner] = group
        self._count(group, num_blocks)
        return table

    def blocks_needed(self, owner: str, num_tokens_total: int) -> int:
        """Blocks `owner` must add to hold `num_tokens_total` tokens (0 if it has room)."""
        need = -(-num_tokens_total // self.block_size) - len(self._tables[owner])
        return need if need > 0 else 0

    def can_append(self, owner: str, num_tokens_total: int) -> bool:
        return self.blocks_needed(owner, num_tokens_total) <= self.num_free

    def append_slots(self, owner: str, num_tokens_total: int) -> None:
        """Grow the owner's table to ceil(num_tokens_total / block_size) blocks."""
        table = self._tables[owner]
        need = -(-num_tokens_total // self.block_size) - len(table)
        if need > 0:
            assert need <= self.num_free, (owner, need, self.num_free)
            table.extend(self._take(need))
            self._count(self._group_of[owner], need)

    def free(self, owner: str) -> int:
        table = self._tables.pop(owner)  # KeyError: freeing an unknown owner is a bug
        cache = self.cache
        if cache is None:
            self._free.extend(reversed(table))
        else:  # tail first, as vLLM: a request's last blocks are evicted before its prefix
            self._num_hashed.pop(owner, None)
            free = self._free
            for block in reversed(table):
                if not cache.release(block):
                    free.append(block)
        self._count(self._group_of.pop(owner), -len(table))
        return len(table)

    def cache_full_blocks(self, owner: str, hashes: Sequence[int], num_computed_tokens: int) -> None:
        """Offer the owner's blocks that are now full and computed to the prefix cache, under the
        request's chained hashes (`hashes` covers the full blocks whose tokens are known)."""
        cache = self.cache
        if cache is None:
            return
        upto = min(len(hashes), num_computed_tokens // self.block_size)
        start = self._num_hashed.get(owner, 0)
        if upto <= start:
            return
        table = self._tables[owner]
        for i in range(start, upto):
            cache.register(table[i], hashes[i])
        self._num_hashed[owner] = upto

    # -- reservations for incoming migrations --------------------------------------------------

    def reserve(self, lease_id: str, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` more blocks out of the free pool for a lease (a lease may grow
        stage by stage); None, and nothing taken, if there are not enough."""
        assert num_blocks >= 0, num_blocks
        if num_blocks > self.num_free:
            return None
        blocks = self._take(num_blocks)
        self._reserved.setdefault(lease_id, []).extend(blocks)
        self._num_reserved += num_blocks
        return blocks

    def pin_cached(self, lease_id: str, blocks: Sequence[int]) -> None:
        """An incoming migration binds to cached blocks holding the request's leading prefix
        (`PrefixCache.longest_hit`): the lease holds them (no longer evictable) and they lead its
        table at the commit. Only before the lease reserves anything."""
        assert lease_id not in self._reserved and lease_id not in self._pinned, lease_id
        cache = self.cache
        assert cache is not None or not blocks
        for block in blocks:
            cache.acquire(block)
        if blocks:
            self._pinned[lease_id] = list(blocks)

    def pinned_blocks(self) -> set[int]:
        """Cached blocks pinned by every lease."""
        return {b for blocks in self._pinned.values() for b in blocks}

    def pinned_of(self, lease_id: str) -> list[int]:
        """The lease's pinned cached blocks (the request's leading prefix, as its source named it)."""
        return list(self._pinned.get(lease_id, ()))

    def reserved_blocks(self, lease_id: str) -> list[int]:
        """The lease's blocks in the request's order: the pinned cached prefix, then the reserved."""
        return self._pinned.get(lease_id, []) + self._reserved.get(lease_id, [])

    def release(self, lease_id: str) -> int:
        """Return a lease's blocks to the free pool (pinned ones to the cache); idempotent (0 for
        an unknown lease)."""
        pinned = self._pinned.pop(lease_id, [])
        for block in pinned:
            self.cache.release(block)
        blocks = self._reserved.pop(lease_id, None)
        if blocks is None:
            return len(pinned)
        self._num_reserved -= len(blocks)
        self._free.extend(reversed(blocks))
        return len(pinned) + len(blocks)

    def adopt(self, lease_id: str, owner: str, group: int = 0) -> list[int]:
        """Migration commit: the lease's blocks (pinned, then reserved in reservation order)
        become `owner`'s table."""
        assert owner not in self._tables, f"adopt onto existing owner {owner}"
        pinned = self._pinned.pop(lease_id, [])
        blocks = self._reserved.pop(lease_id, [] if pinned else None)
        if blocks is None:
            raise KeyError(lease_id)  # an unknown lease is a bug
        self._num_reserved -= len(blocks)
        table = pinned + blocks
        if pinned:  # already cached: not offered again
            self._num_hashed[owner] = len(pinned)
        self._tables[owner] = table
        self._group_of[owner] = group
        self._count(group, len(table))
        return list(table)

    # -- internals -----------------------------------------------------------------------------

    def _count(self, group: int, delta: int) -> None:
        total = self._group_blocks.get(group, 0) + delta
        if total:
            self._group_blocks[group] = total
        else:
            self._group_blocks.pop(group, None)

    def _take(self, num_blocks: int) -> list[int]:
        if num_blocks == 0:
            return []
        free = self._free
        if num_blocks > len(free):  # only with a prefix cache: evict what the plain blocks lack
            cache = self.cache
            assert cache is not None, (num_blocks, len(free))
            evicted = [cache.evict() for _ in range(num_blocks - len(free))]
            evicted.reverse()
            free[:0] = evicted  # taken last, i.e. after the plain free blocks
        taken = free[-num_blocks:]
        del free[-num_blocks:]
        taken.reverse()
        return taken

    def check_invariants(self) -> None:
        owned = [b for table in (*self._tables.values(), *self._pinned.values()) for b in table]
        reserved = [b for blocks in self._reserved.values() for b in blocks]
        cache = self.cache
        if cache is not None:
            cache.check_invariants([*self._tables.values(), *self._pinned.values()])
            evictable = cache.evictable_blocks()
            assert not set(evictable) & set(owned), "an evictable block is held by a table"
            assert not any(cache.is_cached(b) for b in self._free + reserved), "a cached block is plain free"
            owned = sorted(set(owned))  # shared cached blocks count once
        else:
            evictable = []
        everything = self._free + evictable + owned + reserved
        assert len(everything) == self.num_blocks, (len(self._free), len(owned), len(reserved))
        assert sorted(everything) == list(range(self.num_blocks)), "a block is lost or duplicated"
        assert self._num_reserved == len(reserved)
        assert self.num_used == len(owned)
        by_group: dict[int, int] = {}
        for owner, table in self._tables.items():
            if table:
                by_group[self._group_of[owner]] = by_group.get(self._group_of[owner], 0) + len(table)
        assert by_group == self._group_blocks, (by_group, self._group_blocks)
