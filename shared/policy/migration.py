"""Migration pairing (global) and request selection (on the source llumlet)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.messages import LoadReport
from shared.policy.config import PolicyConfig
from shared.policy.freeness import QueueDemand, freeness


@dataclass(frozen=True)
class MigrationPair:
    src: str
    dst: str


def pair_migrations(loads: Sequence[LoadReport], config: PolicyConfig) -> list[MigrationPair]:
    """Sources: head-of-line freeness below the low threshold (draining instances always are);
    destinations: above the high threshold and not draining. Pair the lowest source with the
    highest destination, repeatedly. The gap between the thresholds is what stops thrashing: a
    request only moves from an instance that is short of memory to one that has plenty."""
    scored = [(freeness(l, config.headroom_blocks, QueueDemand.HEAD), l) for l in loads]
    sources = sorted(
        ((f, l.instance_id) for f, l in scored if l.num_running > 0 and f < config.migrate_out_freeness),
    )
    dests = sorted(
        ((f, l.instance_id) for f, l in scored if not l.draining and f > config.migrate_in_freeness),
        key=lambda item: (-item[0], item[1]),
    )
    pairs = []
    for (_, src), (_, dst) in zip(sources, dests):
        if len(pairs) >= config.max_pairs_per_round:
            break
        pairs.append(MigrationPair(src, dst))
    return pairs


@dataclass(frozen=True)
class MigrationCandidate:
    request_id: str
    priority: int
    num_tokens: int


def select_request_to_migrate(candidates: Sequence[MigrationCandidate]) -> MigrationCandidate | None:
    """Lower priority first (a larger priority value is less important), then the shortest
    sequence: it frees the source soonest per byte copied."""
    if not candidates:
        return None
    return min(candidates, key=lambda c: (-c.priority, c.num_tokens, c.request_id))
