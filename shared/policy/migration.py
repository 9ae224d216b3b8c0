"""The one migration policy: pairing (global scheduler), the anti-thrash guard (scheduler,
destination llumlet), request selection and the stage rule (source llumlet). The services and
the simulator call these same functions with the same defaults, so `loadgen simulate` measures
the migration the llumlets run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from shared.messages import LoadReport
from shared.policy.config import PolicyConfig
from shared.policy.freeness import QueueDemand, freeness


@dataclass(frozen=True)
class MigrationGuard:
    """Rules on top of the threshold bands that stop migration from thrashing near saturation.

    Near saturation every instance is short of memory: a request moved off a fragmented
    instance lands on one that soon needs the room itself, preempts, and the cycle repeats.
    """

    # A destination with queued requests needs its free blocks for them.
    dest_max_waiting: int = 0
    # The destination must be this much freer than the source (blocks per running request).
    min_freeness_gap: float = 10.0
    # A request stays this long on an instance (since it arrived or migrated in) before it may
    # move again: no ping-pong.
    min_residence_s: float = 1.0
    # After taking the request, the destination must keep at least this fraction of its blocks
    # free: it must not become the next source.
    dest_min_free_fraction_after: float = 0.1
    # A request does not move back to an instance it left less than this long ago (the
    # residence guard alone lets it bounce between two instances once a second).
    min_return_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.dest_max_waiting, self.min_residence_s, self.min_freeness_gap, self.min_return_s) < 0:
            raise ValueError("dest_max_waiting, min_residence_s, min_freeness_gap and min_return_s must be >= 0")
        if not 0 <= self.dest_min_free_fraction_after < 1:
            raise ValueError("dest_min_free_fraction_after must be in [0, 1)")


@dataclass(frozen=True)
class StageRule:
    """When live migration stops copying while the request decodes and takes the last stage.

    A live stage copies the full blocks added since the previous one. When at most
    `last_stage_blocks` new full blocks remain, or at the `stage_limit`-th stage, the request
    leaves the batch and the rest (with the partial last block) is copied while it is suspended.
    With 0, the last stage holds only what the previous (short) stage let the request add, so the
    downtime does not grow with the sequence; an extra stage of a block or two costs ~2 ms,
    off-line. (Measured on the 2-core VM: threshold 2 → final stages of 1 or 2 blocks, downtime
    2.6-4.4 ms growing with length; threshold 0 → 2.0-3.1 ms, flat.)
    """

    stage_limit: int = 6  # 1: a blocking copy (the last stage at once)
    last_stage_blocks: int = 0

    def __post_init__(self) -> None:
        if self.stage_limit < 1:
            raise ValueError("stage_limit must be at least 1 (1 = blocking copy)")
        if self.last_stage_blocks < 0:
            raise ValueError("last_stage_blocks must be >= 0")


DEFAULT_GUARD = MigrationGuard()
DEFAULT_STAGES = StageRule()

# Migrations in flight per instance, out and in counted apart (the llumlets' --migration-max-out
# and --migration-max-in; the simulator's same defaults). One out: a source's copy stages share
# its link and its steps. Two in: a destination is where the freeness rule sends several sources.
DEFAULT_MAX_OUT = 1
DEFAULT_MAX_IN = 2
# After a destination refused or aborted a migration, its source starts none to it for this long
# while that pair stands (the llumlets' and the simulator's): the next round may pair elsewhere.
REFUSED_BACKOFF_S = 0.5
# A source with a pair but nothing it may start (no candidate, a back-off) looks again after this
# long, while the pair stands (the llumlets' and the simulator's).
IDLE_POLL_S = 0.02


def next_stage(rule: StageRule, stages_done: int, full_blocks: int, blocks_sent: int) -> int | None:
    """The next stage of a migration: the number of full blocks a live stage copies (those in
    [blocks_sent, full_blocks)), or None for the last stage (suspend, copy the rest).

    `full_blocks`: the request's blocks whose content is final (computed tokens // block size)."""
    new_blocks = full_blocks - blocks_sent
    if stages_done >= rule.stage_limit - 1 or new_blocks <= rule.last_stage_blocks:
        return None
    return new_blocks


def may_migrate_into(
    *, num_blocks: int, num_blocks_free: int, num_blocks_total: int, num_waiting: int, guard: MigrationGuard,
    draining: bool = False, num_blocks_committed: int = 0,
) -> bool:
    """Whether a destination with these numbers can take a request of `num_blocks` and keep
    its guard margin free (no queue there, enough blocks left afterwards).

    `num_blocks_committed`: free blocks that prompts admitted there still have to claim (the
    engine checked their whole sequence fits, and allocates it chunk by chunk). They are not
    free to take: a migration that took them would preempt the prompt at its next chunk."""
    if draining or num_waiting > guard.dest_max_waiting:
        return False
    free_after = num_blocks_free - num_blocks_committed - num_blocks
    return free_after >= guard.dest_min_free_fraction_after * num_blocks_total


def is_migratable(*, num_output_tokens: int, num_computed_tokens: int, num_tokens: int, recovering: bool) -> bool:
    """A request may be picked to migrate only while it decodes: it has sampled a token, its KV
    covers everything but the last token, and it is not recomputing after a preemption. A
    request in (chunked) prefill is never a candidate: its blocks are not all there yet, and
    moving it would carry its unallocated claim onto an instance that never admitted it."""
    return num_output_tokens >= 1 and num_computed_tokens == num_tokens - 1 and not recovering


def may_move(*, residence_s: float, left_destination_s_ago: float | None, guard: MigrationGuard) -> bool:
    """The per-request limits, shared by the live source and the simulator: it has stayed at
    least `min_residence_s` where it is (since it arrived or migrated in), and it did not leave
    the destination less than `min_return_s` ago (None: it was never there)."""
    if residence_s < guard.min_residence_s:
        return False
    return left_destination_s_ago is None or left_destination_s_ago >= guard.min_return_s


@dataclass(frozen=True)
class MigrationPair:
    src: str
    dst: str


@dataclass(frozen=True)
class CacheAffinity:
    """Pairing's bounded preference for a destination whose prefix cache already holds the
    moving request's leading blocks: those need no copy, and the request binds to them there.

    Only destinations the bands and the guard admit compete, and only those within
    `max_freeness_loss` (a fraction of the freest remaining destination's freeness) of the freest:
    among them the longest cached prefix wins, ties by freeness. Affinity never takes a
    destination the guard refuses, nor one much fuller than the freest."""

    max_freeness_loss: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.max_freeness_loss < 1:
            raise ValueError("max_freeness_loss must be in [0, 1)")


DEFAULT_AFFINITY = CacheAffinity()

# For a source: destination instance -> leading blocks of the request that source would move
# which that destination's cache holds (instances holding none may be left out).
CachedPrefixOf = Callable[[str], Mapping[str, int]]


def pair_migrations(
    loads: Sequence[LoadReport], config: PolicyConfig, guard: MigrationGuard | None,
    cached_prefix: CachedPrefixOf | None = None, affinity: CacheAffinity = DEFAULT_AFFINITY,
    no_destinations: Collection[str] = frozenset(),
) -> list[MigrationPair]:
    """Sources: head-of-line freeness below the low threshold (draining instances always are);
    destinations: above the high threshold and not draining. Pair the lowest source with the
    highest destination, repeatedly. The gap between the thresholds is what stops thrashing: a
    request only moves from an instance that is short of memory to one that has plenty.

    With a `guard` (None: the bands alone), destinations also have no more than
    `dest_max_waiting` queued requests, and pairing stops at the first source whose freeness gap
    to the freest remaining destination is below `min_freeness_gap`.

    With `cached_prefix`, each source takes, among the remaining destinations that keep the gap
    and are within `affinity` of the freest, the one holding most of its request's prefix
    (`CacheAffinity`); without it (or with no hit anywhere) the freest, as above.

    `no_destinations` may be sources but are never destinations (prefill instances)."""
    scored = [(freeness(l, config.headroom_blocks, QueueDemand.HEAD), l) for l in loads]
    sources = sorted((f, l.instance_id) for f, l in scored if l.num_running > 0 and f < config.migrate_out_freeness)
    max_waiting = guard.dest_max_waiting if guard is not None else None
    dests = sorted(
        (
            (f, l.instance_id)
            for f, l in scored
            if not l.draining and f > config.migrate_in_freeness and l.instance_id not in no_destinations
            and (max_waiting is None or l.num_waiting <= max_waiting)
        ),
        key=lambda item: (-item[0], item[1]),
    )
    min_gap = guard.min_freeness_gap if guard is not None else 0.0
    pairs = []
    for src_f, src in sources:
        if len(pairs) >= config.max_pairs_per_round or not dests or dests[0][0] - src_f < min_gap:
            break
        chosen = 0
        if cached_prefix is not None:
            chosen = _affine_destination(dests, src_f, min_gap, cached_prefix(src), affinity)
        pairs.append(MigrationPair(src, dests.pop(chosen)[1]))
    return pairs


def _affine_destination(
    dests: Sequence[tuple[float, str]], src_f: float, min_gap: float, cached: Mapping[str, int], affinity: CacheAffinity
) -> int:
    """Index in `dests` (freest first) of the destination holding the longest prefix among those
    close enough to the freest; 0 (the freest) when none holds any."""
    floor = max(dests[0][0] - affinity.max_freeness_loss * abs(dests[0][0]), src_f + min_gap)
    best, best_blocks = 0, cached.get(dests[0][1], 0)
    for i, (f, dst) in enumerate(dests):
        if f < floor:
            break
        if cached.get(dst, 0) > best_blocks:  # strictly more: ties stay with the freer
            best, best_blocks = i, cached[dst]
    return best


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
