"""Paged KV block accounting: which block ids are free, owned by a request, or reserved.

Only counts and ids; the bytes (when there are any) live in `kv_pool.KVPool`. Reservations hold
blocks for an incoming migration under a lease id until it commits (`adopt`) or is dropped
(`release`). Each owner belongs to a group (the scheduler uses its priority) whose block total is
kept up to date, so a load report never walks the block tables.
"""

from __future__ import annotations


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: freed blocks are reused first, like vLLM's free block queue for recent frees.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._reserved: dict[str, list[int]] = {}
        self._num_reserved = 0
        self._group_of: dict[str, int] = {}
        self._group_blocks: dict[int, int] = {}  # group -> blocks its owners hold (0s dropped)

    # -- counts --------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        return self._num_reserved

    @property
    def num_used(self) -> int:
        """Blocks owned by requests (reservations not included)."""
        return self.num_blocks - len(self._free) - self._num_reserved

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
        return num_blocks <= len(self._free)

    def allocate(self, owner: str, num_blocks: int, group: int = 0) -> list[int]:
        assert owner not in self._tables, f"double allocate for {owner}"
        assert 0 <= num_blocks <= len(self._free), (num_blocks, len(self._free))
        table = self._take(num_blocks)
        self._tables[owner] = table
        self._group_of[owner] = group
        self._count(group, num_blocks)
        return table

    def blocks_needed(self, owner: str, num_tokens_total: int) -> int:
        """Blocks `owner` must add to hold `num_tokens_total` tokens (0 if it has room)."""
        need = -(-num_tokens_total // self.block_size) - len(self._tables[owner])
        return need if need > 0 else 0

    def can_append(self, owner: str, num_tokens_total: int) -> bool:
        return self.blocks_needed(owner, num_tokens_total) <= len(self._free)

    def append_slots(self, owner: str, num_tokens_total: int) -> None:
        """Grow the owner's table to ceil(num_tokens_total / block_size) blocks."""
        table = self._tables[owner]
        need = -(-num_tokens_total // self.block_size) - len(table)
        if need > 0:
            assert need <= len(self._free), (owner, need, len(self._free))
            table.extend(self._take(need))
            self._count(self._group_of[owner], need)

    def free(self, owner: str) -> int:
        table = self._tables.pop(owner)  # KeyError: freeing an unknown owner is a bug
        self._free.extend(reversed(table))
        self._count(self._group_of.pop(owner), -len(table))
        return len(table)

    # -- reservations for incoming migrations --------------------------------------------------

    def reserve(self, lease_id: str, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` more blocks out of the free pool for a lease (a lease may grow
        stage by stage); None, and nothing taken, if there are not enough."""
        assert num_blocks >= 0, num_blocks
        if num_blocks > len(self._free):
            return None
        blocks = self._take(num_blocks)
        self._reserved.setdefault(lease_id, []).extend(blocks)
        self._num_reserved += num_blocks
        return blocks

    def reserved_blocks(self, lease_id: str) -> list[int]:
        return list(self._reserved.get(lease_id, ()))

    def release(self, lease_id: str) -> int:
        """Return a lease's blocks to the free pool; idempotent (0 for an unknown lease)."""
        blocks = self._reserved.pop(lease_id, None)
        if blocks is None:
            return 0
        self._num_reserved -= len(blocks)
        self._free.extend(reversed(blocks))
        return len(blocks)

    def adopt(self, lease_id: str, owner: str, group: int = 0) -> list[int]:
        """Migration commit: the lease's blocks, in reservation order, become `owner`'s table."""
        assert owner not in self._tables, f"adopt onto existing owner {owner}"
        blocks = self._reserved.pop(lease_id)  # KeyError: unknown lease is a bug
        self._num_reserved -= len(blocks)
        self._tables[owner] = blocks
        self._group_of[owner] = group
        self._count(group, len(blocks))
        return list(blocks)

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
        taken = free[-num_blocks:]
        del free[-num_blocks:]
        taken.reverse()
        return taken

    def check_invariants(self) -> None:
        owned = [b for table in self._tables.values() for b in table]
        reserved = [b for blocks in self._reserved.values() for b in blocks]
        everything = self._free + owned + reserved
        assert len(everything) == self.num_blocks, (len(self._free), len(owned), len(reserved))
        assert sorted(everything) == list(range(self.num_blocks)), "a block is lost or duplicated"
        assert self._num_reserved == len(reserved)
        assert self.num_used == len(owned)
        by_group: dict[int, int] = {}
        for owner, table in self._tables.items():
            if table:
                by_group[self._group_of[owner]] = by_group.get(self._group_of[owner], 0) + len(table)
        assert by_group == self._group_blocks, (by_group, self._group_blocks)
