"""Auto-scaling: keep the average freeness of normal-priority load inside [x, y].

With prefill/decode disaggregation (issue 19 §2) each pool scales on its own signal
(`pool_scaling_decision`): decode instances on their average freeness (the band above), prefill
instances on the prompt tokens queued for their prefill (what TTFT waits behind).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.messages import InstanceRole, LoadReport
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


@dataclass(frozen=True)
class PrefillBand:
    """The prefill pool's signal: prompt tokens queued for prefill per instance. Out while above
    `scale_out_tokens` (TTFT grows with the queue); in while at most `scale_in_tokens` and the
    pool's average freeness is above the freeness band (its memory idles)."""

    scale_out_tokens: int = 4096
    scale_in_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.scale_in_tokens < self.scale_out_tokens:
            raise ValueError("need 0 <= scale_in_tokens < scale_out_tokens")


def queued_prefill_tokens(loads: Sequence[LoadReport]) -> float | None:
    """Average over live instances of the tokens their queued requests need prefilled (their
    whole-queue demand, in blocks, times the block size)."""
    live = [l for l in loads if not l.draining]
    if not live:
        return None
    return sum(l.waiting_demand_blocks * l.block_size for l in live) / len(live)


def scaling_decision(
    loads: Sequence[LoadReport], state: ScalingState, config: ScalingConfig, now: float, pending: int = 0
) -> tuple[ScalingDecision, ScalingState]:
    """`pending` counts instances started but not yet reporting, so they count toward the max
    and a slow start does not trigger a second scale-out."""
    avg = average_normal_freeness(loads)
    busy = avg is not None and avg < config.scale_out_below
    idle = avg is not None and avg > config.scale_in_above
    return _band_decision(loads, avg, busy, idle, state, config, now, pending)


def pool_scaling_decision(
    role: InstanceRole, loads: Sequence[LoadReport], state: ScalingState, config: ScalingConfig,
    band: PrefillBand, now: float, pending: int = 0,
) -> tuple[ScalingDecision, ScalingState]:
    """One pool's decision over its own instances (`loads` may hold every instance): decode by
    the freeness band, prefill by its queued prefill tokens; `config`'s limits are per pool."""
    pool = [l for l in loads if l.role is role]
    if role is not InstanceRole.PREFILL:
        return scaling_decision(pool, state, config, now, pending)
    avg, queued = average_normal_freeness(pool), queued_prefill_tokens(pool)
    busy = queued is not None and queued > band.scale_out_tokens
    idle = queued is not None and queued <= band.scale_in_tokens and avg is not None and avg > config.scale_in_above
    return _band_decision(pool, avg, busy, idle, state, config, now, pending)


def _band_decision(
    loads: Sequence[LoadReport], avg: float | None, busy: bool, idle: bool, state: ScalingState,
    config: ScalingConfig, now: float, pending: int,
) -> tuple[ScalingDecision, ScalingState]:
    """Out once `busy` held for the sustain window, in once `idle` did, never while cooling down
    or past the limits."""
    live = [l for l in loads if not l.draining]
    if avg is None:
        if pending == 0 and config.min_instances > 0:
            return ScalingDecision(ScaleAction.OUT), replace(state, last_action_at=now)
        return ScalingDecision(ScaleAction.NONE), state
    below_since = (state.below_since if state.below_since is not None else now) if busy else None
    above_since = (state.above_since if state.above_since is not None else now) if idle else None
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
