"""Auto-scaling: keep the average freeness of normal-priority load inside [x, y]."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.messages import LoadReport
from shared.policy.config import ScalingConfig
from shared.policy.freeness import QueueDemand, freeness


class ScaleAction(enum.Enum):
    NONE = "none"
    OUT = "out"
    IN = "in"


@dataclass(frozen=True)
class ScalingState:
    """What the policy remembers between ticks: when the average left the band, last action."""

    below_since: float | None = None
    above_since: float | None = None
    last_action_at: float | None = None


@dataclass(frozen=True)
class ScalingDecision:
    action: ScaleAction
    victim: str | None = None
    average_freeness: float | None = None


def average_normal_freeness(loads: Sequence[LoadReport]) -> float | None:
    """Average over live (non-draining) instances, without execution-priority headroom: the
    band is about how much room normal-priority load has. Queued demand counts in full."""
    live = [l for l in loads if not l.draining]
    if not live:
        return None
    return sum(freeness(l, {}, QueueDemand.ALL) for l in live) / len(live)


def scaling_decision(
    loads: Sequence[LoadReport], state: ScalingState, config: ScalingConfig, now: float, pending: int = 0
) -> tuple[ScalingDecision, ScalingState]:
    """`pending` counts instances started but not yet reporting, so they count toward the max
    and a slow start does not trigger a second scale-out."""
    live = [l for l in loads if not l.draining]
    avg = average_normal_freeness(loads)
    if avg is None:
        if pending == 0 and config.min_instances > 0:
            return ScalingDecision(ScaleAction.OUT), replace(state, last_action_at=now)
        return ScalingDecision(ScaleAction.NONE), state
    below_since = (state.below_since if state.below_since is not None else now) if avg < config.scale_out_below else None
    above_since = (state.above_since if state.above_since is not None else now) if avg > config.scale_in_above else None
    state = replace(state, below_since=below_since, above_since=above_since)
    cooling = state.last_action_at is not None and now - state.last_action_at < config.cooldown_s
    n = len(live) + pending
    if cooling:
        return ScalingDecision(ScaleAction.NONE, average_freeness=avg), state
    if below_since is not None and now - below_since >= config.sustain_s and n < config.max_instances:
        return ScalingDecision(ScaleAction.OUT, average_freeness=avg), replace(state, last_action_at=now, below_since=None)
    if above_since is not None and now - above_since >= config.sustain_s and len(live) > config.min_instances:
        victim = min(live, key=lambda l: (l.num_running + l.num_waiting, l.instance_id)).instance_id
        return ScalingDecision(ScaleAction.IN, victim=victim, average_freeness=avg), replace(
            state, last_action_at=now, above_since=None
        )
    return ScalingDecision(ScaleAction.NONE, average_freeness=avg), state
