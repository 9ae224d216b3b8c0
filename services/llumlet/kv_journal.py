"""What an engine's prefix cache holds, as it changes: the journal an engine writes to (the sim
engine's `PrefixCache`, vLLM's own KV events in process) and `services.llumlet.kv_events` sends.

The journal mirrors the set of hashes held and keeps the net change since the last `take()`. A
hash stored then evicted between two messages travels as removed, one evicted then stored again as
stored: the index applies a message's removals before its stores, and the two lists are disjoint,
so the order inside a batch cannot matter. Locked: vLLM writes from its engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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

    def removed(self, block_hashes: Iterable[int]) -> None:
        with self._lock:
            for block_hash in block_hashes:
                self._held.discard(block_hash)
                self._changes[block_hash] = False

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
