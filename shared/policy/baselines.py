"""Named scheduling policies (Corral and the Llumnix paper's baselines), as pure functions.

- `round-robin`: requests go to the instances in turn, no migration.
- `infaas++`: least memory load including the queued demand (INFaaS made LLM-aware, as the
  paper's baseline), no migration.
- `llumnix-base`: freeness dispatch and migration, every request treated as one priority.
- `corral`: freeness dispatch, migration (de-fragmentation), scheduling priority (a local
  priority queue) and execution priority (headroom); auto-scaling when enabled.

Prefix-aware ones (shared.policy.prefix_dispatch; they need a prefix index, without one every
instance holds nothing), not in the default comparison set `POLICY_NAMES`:
- `corral-prefix`: corral with dispatch by predicted TTFT under the freeness guard.
- `prefix-only`: longest cached prefix wins, ties by freeness; no migration.
- `kv-cost`: NVIDIA Dynamo's KV router cost (prefill blocks + decode blocks); no migration.

The simulator and the services select a policy by name and call the same functions.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.messages import DispatchRequest, LoadReport
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import DispatchDecision, choose_instance, dispatchable, pick_tied
from shared.policy.prefix_dispatch import (
    EmptyPrefixIndex,
    PrefixContext,
    choose_by_predicted_ttft,
    choose_longest_prefix,
    choose_min_kv_cost,
)


class DispatchRule(enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_MEMORY = "least-memory"  # INFaaS++
    FREENESS = "freeness"  # choose_instance (dispatch_score): Llumnix-style freeness dispatch
    PREDICTED_TTFT = "predicted-ttft"  # prefix-aware: queued + uncached prefill, freeness guard
    LONGEST_PREFIX = "longest-prefix"  # cache affinity, ties by freeness
    KV_COST = "kv-cost"  # Dynamo's KV router cost

    @property
    def uses_prefix_index(self) -> bool:
        return self in _PREFIX_RULES


@dataclass(frozen=True)
class SchedulingPolicy:
    name: str
    dispatch: DispatchRule
    migration: bool
    # Scheduling priority (a local priority queue, high priority first) and execution priority
    # (headroom). Without it every request is scheduled as normal priority.
    priorities: bool
    description: str

    @property
    def queue_policy(self) -> str:
        return "priority" if self.priorities else "fcfs"

    def policy_config(self, base: PolicyConfig) -> PolicyConfig:
        """`base` as this policy uses it: no headroom for a policy without priorities."""
        return base if self.priorities else replace(base, headroom_blocks={})

    def effective_priority(self, priority: int) -> int:
        return priority if self.priorities else 0


POLICIES: dict[str, SchedulingPolicy] = {
    p.name: p
    for p in (
        SchedulingPolicy("round-robin", DispatchRule.ROUND_ROBIN, migration=False, priorities=False,
                         description="instances in turn; no migration"),
        SchedulingPolicy("infaas++", DispatchRule.LEAST_MEMORY, migration=False, priorities=False,
                         description="least memory load including queued demand; no migration"),
        SchedulingPolicy("llumnix-base", DispatchRule.FREENESS, migration=True, priorities=False,
                         description="freeness dispatch + migration; one priority for all"),
        SchedulingPolicy("corral", DispatchRule.FREENESS, migration=True, priorities=True,
                         description="freeness dispatch + migration + priorities (+ auto-scaling)"),
        SchedulingPolicy("corral-prefix", DispatchRule.PREDICTED_TTFT, migration=True, priorities=True,
                         description="corral, dispatching by predicted TTFT (cached prefix + queue) under freeness"),
        SchedulingPolicy("prefix-only", DispatchRule.LONGEST_PREFIX, migration=False, priorities=False,
                         description="longest cached prefix, ties by freeness; no migration"),
        SchedulingPolicy("kv-cost", DispatchRule.KV_COST, migration=False, priorities=False,
                         description="Dynamo's KV cost: uncached + queued prefill blocks + decode blocks; no migration"),
    )
}
_PREFIX_RULES = frozenset({DispatchRule.PREDICTED_TTFT, DispatchRule.LONGEST_PREFIX, DispatchRule.KV_COST})
# The default comparison set (the Llumnix paper's); the prefix-aware ones are asked for by name.
POLICY_NAMES = ("round-robin", "infaas++", "llumnix-base", "corral")
PREFIX_POLICY_NAMES = tuple(name for name in POLICIES if name not in POLICY_NAMES)


def get_policy(name: str) -> SchedulingPolicy:
    policy = POLICIES.get(name.strip().lower())
    if policy is None:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    return policy


# -- dispatch ----------------------------------------------------------------------------------


def memory_load(load: LoadReport) -> float:
    """INFaaS++'s load: the fraction of KV memory used or claimed, queued demand included."""
    if load.draining:
        return math.inf
    running = sum(level.running_blocks for level in load.by_priority)
    claimed = running + load.waiting_demand_blocks + load.reserved_blocks
    return claimed / load.num_blocks_total


def choose_least_loaded(loads: Sequence[LoadReport], request: DispatchRequest) -> DispatchDecision:
    """INFaaS++: the lowest memory load; ties broken like choose_instance (hash of the id)."""
    live = dispatchable(loads, request)
    if isinstance(live, DispatchDecision):
        return live
    scored = [(memory_load(l), l.instance_id) for l in live]
    best = min(score for score, _ in scored)
    return DispatchDecision(pick_tied([iid for score, iid in scored if score <= best + 1e-9], request))


def choose_round_robin(loads: Sequence[LoadReport], request: DispatchRequest, turn: int) -> DispatchDecision:
    """The `turn`-th live instance in id order (the caller counts turns)."""
    live = dispatchable(loads, request)
    if isinstance(live, DispatchDecision):
        return live
    ids = sorted(l.instance_id for l in live)
    return DispatchDecision(ids[turn % len(ids)])


def dispatch(
    policy: SchedulingPolicy, loads: Sequence[LoadReport], request: DispatchRequest, config: PolicyConfig, turn: int,
    prefix: PrefixContext | None = None,
) -> DispatchDecision:
    """The policy's choice for one request. `config` must already be `policy.policy_config(...)`;
    `prefix` is needed by the prefix-aware rules (without it they see no cached prefix)."""
    rule = policy.dispatch
    if rule is DispatchRule.ROUND_ROBIN:
        return choose_round_robin(loads, request, turn)
    if rule is DispatchRule.LEAST_MEMORY:
        return choose_least_loaded(loads, request)
    if rule.uses_prefix_index:
        prefix = prefix or PrefixContext(EmptyPrefixIndex(), prefill_s=float)  # (time ∝ tokens)
        if rule is DispatchRule.PREDICTED_TTFT:
            return choose_by_predicted_ttft(loads, request, config, prefix)
        if rule is DispatchRule.LONGEST_PREFIX:
            return choose_longest_prefix(loads, request, config, prefix)
        return choose_min_kv_cost(loads, request, config, prefix)
    return choose_instance(loads, request, config)
