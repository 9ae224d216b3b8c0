"""The global prefix index: which block hashes each instance's KV cache holds, as its llumlet
reports them (`KvCacheEvents` in order, `KvCacheSnapshot` to start over), for prefix-aware
dispatch (`shared.policy.prefix_dispatch.PrefixIndex`).

Events carry a per-instance sequence number, from 1 (a snapshot: that of the last event before
it). One that does not follow the last applied (a lost message, a restarted llumlet, a restarted
scheduler hearing an instance mid-stream) is not applied: the instance is marked out of sync until a snapshot arrives (the caller asks for one).
Meanwhile its entries stay: a stale hit costs a mispredicted TTFT, never a wrong answer (the
engine matches its own cache). A hash means the instance holds that block and, the hashes being
chained, every block before it; a prefix matches up to its first missing hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shared.messages import KvCacheEvents, KvCacheSnapshot


_NONE: frozenset[str] = frozenset()


class GlobalPrefixIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}  # instance -> block hashes it holds
        self._holders: dict[int, set[str]] = {}  # block hash -> instances holding it
        self._seq: dict[str, int] = {}  # instance -> seq of the last event or snapshot applied
        self.out_of_sync: set[str] = set()

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

    @property
    def size(self) -> int:
        """Distinct block hashes held anywhere."""
        return len(self._holders)

    # -- updates -------------------------------------------------------------------------------

    def apply(self, events: KvCacheEvents) -> bool:
        """Apply an instance's next events; False (nothing applied, the instance out of sync)
        when they do not follow the last ones applied."""
        iid = events.instance_id
        if iid in self.out_of_sync or events.seq != self._seq.get(iid, 0) + 1:
            self.out_of_sync.add(iid)
            return False
        if events.cleared:
            self._drop(iid)
        self._remove(iid, events.removed)
        self._add(iid, events.stored)
        self._seq[iid] = events.seq
        return True

    def restore(self, snapshot: KvCacheSnapshot) -> bool:
        """Replace an instance's entries with its snapshot (taken after event `seq`), whatever
        its seq: one instance's events and snapshots travel in order on one subscription, so a
        snapshot is never older than what was applied — unless the llumlet restarted (its seq
        begins again), and then the snapshot is the truth. True: the instance is in sync."""
        iid = snapshot.instance_id
        self._drop(iid)
        self._add(iid, snapshot.block_hashes)
        self._seq[iid] = snapshot.seq
        self.out_of_sync.discard(iid)
        return True

    def forget(self, instance_id: str) -> None:
        """The instance is gone (expired, drained): nothing of it stays."""
        self._drop(instance_id)
        self._seq.pop(instance_id, None)
        self.out_of_sync.discard(instance_id)

    def _add(self, instance_id: str, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(instance_id, set())
        for block_hash in hashes:
            if block_hash not in held:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(instance_id)

    def _remove(self, instance_id: str, hashes: Iterable[int]) -> None:
        held = self._held.get(instance_id)
        if not held:
            return
        for block_hash in hashes:
            if block_hash in held:
                held.discard(block_hash)
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
