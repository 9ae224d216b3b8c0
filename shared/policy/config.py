"""Tunables of the global policies, in one typed place (units in the names)."""

from __future__ import annotations

from dataclasses import dataclass, field

NORMAL_PRIORITY = 0
HIGH_PRIORITY = -1  # lower value = more important, as vLLM's `priority` field


@dataclass(frozen=True)
class PolicyConfig:
    # Execution priority: blocks of KV kept free for each priority level, split among that
    # level's requests on an instance (Algorithm 1, GetHeadroom). Normal priority gets none.
    headroom_blocks: dict[int, int] = field(default_factory=lambda: {HIGH_PRIORITY: 100})
    # Migration pairing bands on head-of-line freeness (blocks per running request).
    migrate_out_freeness: float = 1.0
    migrate_in_freeness: float = 10.0
    max_pairs_per_round: int = 8
    # Dispatch ties: instances whose freeness is within this of the best count as tied.
    tie_epsilon: float = 1e-6
    # Early rejection: refuse a request when even the freest instance is below this
    # (None: never reject, queue instead).
    reject_below_freeness: float | None = None


@dataclass(frozen=True)
class ScalingConfig:
    """Auto-scaling band on the average freeness of normal-priority load."""

    scale_out_below: float = 2.0
    scale_in_above: float = 40.0
    sustain_s: float = 5.0
    cooldown_s: float = 10.0
    min_instances: int = 1
    max_instances: int = 16
