"""Named scheduling policies (Corral and the Llumnix paper's baselines), as pure functions.

- `round-robin`: requests go to the instances in turn, no migration.
- `infaas++`: least memory load including the queued demand (INFaaS made LLM-aware, as the
  paper's baseline), no migration.
- `llumnix-base`: freeness dispatch and migration, every request treated as one priority.
- `corral`: freeness dispatch, migration (de-fragmentation), scheduling priority (a local
  priority queue) and execution priority (headroom); auto-scaling when enabled.

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


class DispatchRule(enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_MEMORY = "least-memory"  # INFaaS++
    FREENESS = "freeness"  # choose_instance (dispatch_score): Llumnix-style freeness dispatch


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
    )
}
POLICY_NAMES = tuple(POLICIES)


def get_policy(name: str) -> SchedulingPolicy:
    policy = POLICIES.get(name.strip().lower())
    if policy is None:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
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
    policy: SchedulingPolicy, loads: Sequence[LoadReport], request: DispatchRequest, config: PolicyConfig, turn: int
) -> DispatchDecision:
    """The policy's choice for one request. `config` must already be `policy.policy_config(...)`."""
    if policy.dispatch is DispatchRule.ROUND_ROBIN:
        return choose_round_robin(loads, request, turn)
    if policy.dispatch is DispatchRule.LEAST_MEMORY:
        return choose_least_loaded(loads, request)
    return choose_instance(loads, request, config)
