"""The global prefix index: which block hashes each instance's KV cache holds, as its llumlet
reports them (`KvCacheEvents` in order, `KvCacheSnapshot` to start over), for prefix-aware
dispatch (`shared.policy.prefix_dispatch.PrefixIndex`).

Events carry a per-instance sequence number, from 1 (a snapshot: that of the last event before
it). One that does not follow the last applied (a lost message, a restarted llumlet, a restarted
scheduler hearing an instance mid-stream) is not applied: the instance is marked out of sync
until a snapshot arrives (the caller asks for one). Meanwhile its entries stay: a stale hit costs
a mispredicted TTFT, never a wrong answer (the engine matches its own cache). A hash means the
instance holds that block and, the hashes being chained, every block before it; a prefix matches
up to its first missing hash.

A snapshot (every llumlet sends one every few seconds) costs what it changes: one matching what
is held changes nothing, another only its difference. An instance may hold at most `bound()`
blocks, from its reported cache size (`capacity`): events past it are treated as a gap, and a
snapshot past it is refused (the instance forgotten, out of sync), so a misbehaving llumlet
cannot grow the index without limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from shared.messages import MAX_SNAPSHOT_HASHES, KvCacheEvents, KvCacheSnapshot

# In sync, the index holds what the engine holds, at most its capacity, and a message stores at
# most that many more (its stores are held after it): twice the capacity is never exceeded then,
# and the check (held + stored) costs O(1). The slack: a small cache's reporting noise (a cache
# resized by a restart, blocks the load report does not count).
CAPACITY_FACTOR = 2
SLACK_BLOCKS = 1024
UNKNOWN_CAPACITY_BLOCKS = MAX_SNAPSHOT_HASHES  # no load report yet (or no `capacity`): a large GPU's

_NONE: frozenset[str] = frozenset()


class GlobalPrefixIndex:
    def __init__(self, capacity: Callable[[str], int | None] | None = None, snapshot_part: int | None = None) -> None:
        """`capacity`: an instance's KV cache size in blocks, None if unknown. `snapshot_part`:
        the size of the first part of a snapshot too large for one message (the rest follows as
        stores), None if snapshots are always whole."""
        self._capacity = capacity
        self._snapshot_part = snapshot_part
        self._held: dict[str, set[int]] = {}  # instance -> block hashes it holds
        self._holders: dict[int, set[str]] = {}  # block hash -> instances holding it
        self._seq: dict[str, int] = {}  # instance -> seq of the last event or snapshot applied
        self.out_of_sync: set[str] = set()
        self.over_bound: set[str] = set()  # out of sync for reporting more than bound(): a snapshot within heals

    # -- queries (PrefixIndex) -----------------------------------------------------------------

    def matched_blocks(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        held = self._held.get(instance_id)
        if not held:
            return 0
        n = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            n += 1
        return n

    def matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Every instance holding a prefix of the chain, with its length: O(blocks matched),
        whatever the number of instances (those holding nothing are left out)."""
        if not block_hashes:
            return {}
        alive = set(self._holders.get(block_hashes[0], ()))
        matched: dict[str, int] = {}
        depth, length, holders = 0, len(block_hashes), self._holders
        while alive:
            depth += 1
            nxt = holders.get(block_hashes[depth], _NONE) if depth < length else _NONE
            if alive <= nxt:  # every one still holds it (the usual case): no set built
                continue
            lost = alive - nxt
            for instance_id in lost:
                matched[instance_id] = depth
            alive -= lost
        return matched

    def in_sync(self, instance_id: str) -> bool:
        """Known from a snapshot or from its first event, and no gap since."""
        return instance_id in self._seq and instance_id not in self.out_of_sync

    def instances(self) -> set[str]:
        return set(self._seq) | self.out_of_sync

    def num_blocks(self, instance_id: str) -> int:
        return len(self._held.get(instance_id, ()))

    def bound(self, instance_id: str) -> int:
        """The most blocks the instance may hold here."""
        capacity = self._capacity(instance_id) if self._capacity is not None else None
        return CAPACITY_FACTOR * (UNKNOWN_CAPACITY_BLOCKS if capacity is None else capacity) + SLACK_BLOCKS

    @property
    def size(self) -> int:
        """Distinct block hashes held anywhere."""
        return len(self._holders)

    # -- updates -------------------------------------------------------------------------------

    def apply(self, events: KvCacheEvents) -> bool:
        """Apply an instance's next events; False (nothing applied, the instance out of sync)
        when they do not follow the last ones applied, or would take it past its bound."""
        iid = events.instance_id
        if iid in self.out_of_sync or events.seq != self._seq.get(iid, 0) + 1:
            self.out_of_sync.add(iid)
            return False
        if (0 if events.cleared else self.num_blocks(iid)) + len(events.stored) > self.bound(iid):
            self.out_of_sync.add(iid)
            self.over_bound.add(iid)
            return False
        if events.cleared:
            self._drop(iid)
        self._remove(iid, events.removed)
        self._add(iid, events.stored)
        self._seq[iid] = events.seq
        return True

    def restore(self, snapshot: KvCacheSnapshot) -> bool:
        """Make an instance's entries its snapshot's (taken after event `seq`), whatever its seq:
        one instance's events and snapshots travel in order on one subscription, so a snapshot is
        never older than what was applied — unless the llumlet restarted (its seq begins again),
        and then the snapshot is the truth. True: the instance is in sync. False: the snapshot
        is past the instance's bound, refused; the instance is forgotten, left out of sync."""
        iid = snapshot.instance_id
        hashes = set(snapshot.block_hashes)
        if len(hashes) > self.bound(iid):
            self._drop(iid)
            self.out_of_sync.add(iid)
            self.over_bound.add(iid)
            return False
        held = self._held.get(iid, set())
        if not (self.in_sync(iid) and snapshot.seq == self._seq[iid] and self._agrees(held, hashes)):
            self._remove(iid, held - hashes)
            self._add(iid, hashes)  # (only what is not held yet)
        self._seq[iid] = snapshot.seq
        self.out_of_sync.discard(iid)
        self.over_bound.discard(iid)
        return True

    def forget(self, instance_id: str) -> None:
        """The instance is gone (expired, drained): nothing of it stays."""
        self._drop(instance_id)
        self._seq.pop(instance_id, None)
        self.out_of_sync.discard(instance_id)
        self.over_bound.discard(instance_id)

    def _agrees(self, held: set[int], hashes: set[int]) -> bool:
        """Whether a snapshot at the seq last applied (in sync: the index then holds what it does,
        by construction) shows it: the same hashes, or, for one that may be the first part of a
        snapshot (its rest follows as stores of what is held), a part of them. The check costs
        O(snapshot), in C; one that fails (a restarted llumlet at the same seq) is applied."""
        if not hashes <= held:
            return False
        return len(hashes) == len(held) or len(hashes) == self._snapshot_part

    def _add(self, instance_id: str, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(instance_id, set())
        fresh = set(hashes).difference(held)  # (stores of blocks held, a snapshot's rest: no Python loop)
        held |= fresh
        for block_hash in fresh:
            self._holders.setdefault(block_hash, set()).add(instance_id)

    def _remove(self, instance_id: str, hashes: Iterable[int]) -> None:
        held = self._held.get(instance_id)
        if not held:
            return
        gone = held.intersection(hashes)
        held -= gone
        for block_hash in gone:
            holders = self._holders[block_hash]
            holders.discard(instance_id)
            if not holders:
                del self._holders[block_hash]

    def _drop(self, instance_id: str) -> None:
        for block_hash in self._held.pop(instance_id, ()):
            holders = self._holders[block_hash]
            holders.discard(instance_id)
            if not holders:
                del self._holders[block_hash]
