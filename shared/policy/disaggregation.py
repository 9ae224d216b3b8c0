"""Prefill/decode disaggregation as a live migration (issue 19 §2), as pure functions.

New requests go to prefill (and mixed) instances; when a request's prefill completes on a
prefill instance (its first token), it moves by the ordinary live migration to the decode
instance that is freest *then*, not one picked at arrival. When no decode (or mixed) instance
may take it under the one migration guard, it keeps decoding where it is: the prefill instance
degrades to mixed for that request rather than making it wait.

A fleet without a live prefill instance behaves exactly as before: every instance takes new
requests and nothing hands off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from shared.messages import InstanceRole, LoadReport
from shared.policy.config import PolicyConfig
from shared.policy.freeness import QueueDemand, freeness
from shared.policy.migration import (
    DEFAULT_AFFINITY,
    CacheAffinity,
    CachedPrefixOf,
    MigrationGuard,
    MigrationPair,
    may_migrate_into,
    pair_migrations,
)

# Hand-off destinations, best first: decode instances exist for this; mixed ones only when no
# decode instance has room. Prefill instances never take a hand-off.
HANDOFF_ROLES = (InstanceRole.DECODE, InstanceRole.MIXED)
# "No room" and a destination's refusal are asked about again, a fresh choice each time, this
# many times in all, this far apart (about a load report's interval: a decode instance holds a
# just-committed hand-off queued until its next step, and the guard takes nothing into a queue);
# the request decodes on its prefill instance meanwhile and stays there after the last.
HANDOFF_ATTEMPTS = 3
HANDOFF_RETRY_AFTER_S = 0.05


def wants_handoff(role: InstanceRole) -> bool:
    """Only a prefill instance hands its requests off at their first token."""
    return role is InstanceRole.PREFILL


def has_live_prefill(loads: Sequence[LoadReport]) -> bool:
    return any(l.role is InstanceRole.PREFILL and not l.draining for l in loads)


def dispatch_pool(loads: Sequence[LoadReport]) -> list[LoadReport]:
    """The instances a new request may be dispatched to: prefill and mixed ones while any live
    prefill instance exists (decode instances keep their memory for hand-offs); otherwise all
    of them, so a fleet with no prefill instance (or whose prefill instances are all draining)
    dispatches as it always did rather than refusing."""
    if not has_live_prefill(loads):
        return list(loads)
    return [l for l in loads if l.role is not InstanceRole.DECODE]


def may_take_handoff(load: LoadReport, request_blocks: int, guard: MigrationGuard) -> bool:
    """The destination side of the guard, exactly as a migration's PRE-ALLOC is checked: under
    its limit of migrations in (where it tells it), no queue there, and `request_blocks` leave its
    guard margin free. (At its limit it would refuse: the attempt spent, the request waiting for
    the next, when another destination may take it now.)"""
    if load.max_migrations_in and load.num_migrating_in >= load.max_migrations_in:
        return False
    return may_migrate_into(
        num_blocks=request_blocks, num_blocks_free=load.num_blocks_free, num_blocks_total=load.num_blocks_total,
        num_waiting=load.num_waiting, guard=guard, draining=load.draining,
        num_blocks_committed=load.committed_blocks,
    )


def holds_context(load: LoadReport, num_tokens: int) -> bool:
    """The instance's context fits a sequence of `num_tokens` (an instance or a request that
    says nothing, 0, fits)."""
    return load.max_model_len == 0 or num_tokens <= load.max_model_len


def handoff_destination(
    source: LoadReport,
    loads: Sequence[LoadReport],
    request_blocks: int,
    guard: MigrationGuard,
    headroom_blocks: Mapping[int, int],
    request_max_tokens: int = 0,
) -> str | None:
    """Where a request that just finished its prefill on `source` decodes: the freest decode
    instance that may take its `request_blocks` and whose context holds the `request_max_tokens`
    it may grow to (0: not checked), else the freest such mixed instance; None: it stays on
    `source` (degrades to mixed).

    The guard's per-request limits (residence, return) and its freeness gap are not applied: a
    hand-off moves a request because of the instance's role, not to balance load, and a request
    at its first token has just arrived. Ties go to the smaller instance id (deterministic)."""
    # It can grow no longer than its source's context either (an engine stops it there).
    need = min(request_max_tokens, source.max_model_len) if source.max_model_len else request_max_tokens
    for role in HANDOFF_ROLES:
        eligible = [
            l for l in loads
            if l.role is role and l.instance_id != source.instance_id and may_take_handoff(l, request_blocks, guard)
            and holds_context(l, need)
        ]
        if eligible:
            best = min(eligible, key=lambda l: (-freeness(l, headroom_blocks, QueueDemand.HEAD), l.instance_id))
            return best.instance_id
    return None



def account_handoff(load: LoadReport, num_blocks: int) -> LoadReport:
    """The destination's load once a hand-off's PRE-ALLOC lands (its blocks reserved, one more
    migration in), so that hand-offs answered between two reports spread as dispatches do."""
    return msgspec.structs.replace(
        load,
        num_blocks_free=max(0, load.num_blocks_free - num_blocks),
        reserved_blocks=load.reserved_blocks + num_blocks,
        num_migrating=load.num_migrating + 1,
        num_migrating_in=load.num_migrating_in + 1,
    )


def rebalancing_pairs(
    loads: Sequence[LoadReport], config: PolicyConfig, guard: MigrationGuard | None,
    cached_prefix: CachedPrefixOf | None = None, affinity: CacheAffinity = DEFAULT_AFFINITY,
) -> list[MigrationPair]:
    """The load-balancing pairs (`pair_migrations`) with no prefill instance as a destination: its
    memory is for prompts, and a request moved there would decode beside them, the interference
    disaggregation exists to avoid. Left out before pairing, not after: the prefill instances are
    often the freest, and a source paired with one would get no pair at all. A prefill instance
    may still be a source (requests that degraded to mixed there leave by the ordinary rounds).
    Without prefill instances this is exactly `pair_migrations`."""
    prefill = frozenset(l.instance_id for l in loads if l.role is InstanceRole.PREFILL)
    return pair_migrations(loads, config, guard, cached_prefix, affinity, no_destinations=prefill)
