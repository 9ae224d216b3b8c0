"""What an engine's prefix cache holds, as it changes: the journal an engine writes to (the sim
engine's `PrefixCache`, vLLM's own KV events in process) and `services.llumlet.kv_events` sends.

The journal mirrors the set of hashes held and keeps the net change since the last `take()`. A
hash stored then evicted between two messages travels as removed, one evicted then stored again as
stored: the index applies a message's removals before its stores, and the two lists are disjoint,
so the order inside a batch cannot matter. Locked: vLLM writes from its engine thread.

While nothing is taken (NATS away) the changes pile up here, merged in place; past
`MAX_CHANGES_OVER_HELD` more than is held (an outage under a cache churning for long), they
collapse into "cleared, then everything held": one resync instead of a growing list of hashes
the schedulers may never have heard of.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

MAX_CHANGES_OVER_HELD = 65_536  # net changes kept beyond the number of hashes held (then: a resync)


@dataclass(frozen=True)
class KvDelta:
    cleared: bool
    stored: list[int]
    removed: list[int]

    @property
    def is_empty(self) -> bool:
        return not (self.cleared or self.stored or self.removed)


class KvEventJournal:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._changes: dict[int, bool] = {}  # hash -> held now (net, since the last take)
        self._cleared = False

    def stored(self, block_hashes: Iterable[int]) -> None:
        with self._lock:
            for block_hash in block_hashes:
                self._held.add(block_hash)
                self._changes[block_hash] = True
            self._bound_changes()

    def removed(self, block_hashes: Iterable[int]) -> None:
        with self._lock:
            for block_hash in block_hashes:
                self._held.discard(block_hash)
                self._changes[block_hash] = False
            self._bound_changes()

    def put_back(self, delta: KvDelta) -> None:
        """A taken delta that could not be sent, back under the changes made since (they win)."""
        with self._lock:
            if self._cleared:  # cleared since: what came before it is moot
                return
            for block_hash in delta.stored:
                self._changes.setdefault(block_hash, True)
            for block_hash in delta.removed:
                self._changes.setdefault(block_hash, False)
            self._cleared = delta.cleared
            self._bound_changes()

    def _bound_changes(self) -> None:
        if len(self._changes) > len(self._held) + MAX_CHANGES_OVER_HELD:
            self._changes = dict.fromkeys(self._held, True)
            self._cleared = True

    def cleared(self) -> None:
        with self._lock:
            self._held.clear()
            self._changes.clear()
            self._cleared = True

    @property
    def num_held(self) -> int:
        return len(self._held)

    def take(self) -> KvDelta:
        """The net change since the last take."""
        with self._lock:
            return self._take_locked()

    def take_with_snapshot(self) -> tuple[KvDelta, list[int]]:
        """The net change since the last take and everything held once it is applied."""
        with self._lock:
            return self._take_locked(), list(self._held)

    def _take_locked(self) -> KvDelta:
        changes, self._changes = self._changes, {}
        cleared, self._cleared = self._cleared, False
        return KvDelta(cleared, [h for h, held in changes.items() if held],
                       [h for h, held in changes.items() if not held])


@runtime_checkable
class CachesPrefixes(Protocol):
    """An engine that can tell what its prefix cache holds (None when its cache is off)."""

    def kv_event_journal(self) -> KvEventJournal | None: ...


def journal_of(engine: object) -> KvEventJournal | None:
    return engine.kv_event_journal() if isinstance(engine, CachesPrefixes) else None
