"""Length distributions of the Llumnix paper's Table 1 (BENCHMARKS.md), fitted without scipy.

Each distribution is a quantile function that is piecewise log-linear through the table's
percentiles (P50, P80, P95, P99), so those percentiles hold exactly and every segment is a
power-law-like stretch. The two free ends (the minimum and the maximum, which is capped: 6k
tokens for S/M/L) are solved so that the distribution's mean matches the table's mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_KNOT_PROBS = (0.0, 0.5, 0.8, 0.95, 0.99, 1.0)
_SML_CAP = 6000


@dataclass(frozen=True)
class LengthTable:
    """One row of Table 1: mean and percentiles, with the cap the tail may not exceed."""

    mean: float
    p50: float
    p80: float
    p95: float
    p99: float
    cap: float


TABLE1: dict[str, LengthTable] = {
    "sharegpt-in": LengthTable(306, 74, 348, 1484, 3388, cap=8192),
    "sharegpt-out": LengthTable(500, 487, 781, 988, 1234, cap=2048),
    "burstgpt-in": LengthTable(830, 582, 1427, 2345, 3549, cap=8192),
    "burstgpt-out": LengthTable(271, 243, 434, 669, 964, cap=2048),
    "s": LengthTable(128, 38, 113, 413, 1464, cap=_SML_CAP),
    "m": LengthTable(256, 32, 173, 1288, 4208, cap=_SML_CAP),
    "l": LengthTable(512, 55, 582, 3113, 5166, cap=_SML_CAP),
}
DISTRIBUTION_NAMES = ("S", "M", "L", "sharegpt", "burstgpt")


def _segment_mean(low: float, high: float) -> float:
    """Mean of exp(uniform(log low, log high)): the mean of one log-linear quantile segment."""
    if math.isclose(low, high):
        return low
    return (high - low) / math.log(high / low)


def _mean_of(knots: list[float]) -> float:
    widths = np.diff(_KNOT_PROBS)
    return sum(w * _segment_mean(a, b) for w, a, b in zip(widths, knots, knots[1:]))


def _bisect(func, low: float, high: float, iterations: int = 80) -> float:
    """Root of an increasing function on [low, high] (clamped to an end when there is none)."""
    if func(low) >= 0:
        return low
    if func(high) <= 0:
        return high
    for _ in range(iterations):
        middle = (low + high) / 2
        if func(middle) < 0:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass(frozen=True)
class FittedLengths:
    """A fitted distribution: the quantile knots (tokens) at _KNOT_PROBS."""

    knots: tuple[float, ...]

    @classmethod
    def fit(cls, table: LengthTable) -> FittedLengths:
        inner = [table.p50, table.p80, table.p95, table.p99]

        def mean_with(minimum: float, maximum: float) -> float:
            return _mean_of([minimum, *inner, maximum])

        # Grow the tail first (power-law tails carry the mean), then the head if the cap binds.
        maximum = _bisect(lambda x: mean_with(1.0, x) - table.mean, table.p99, table.cap)
        minimum = _bisect(lambda x: mean_with(x, maximum) - table.mean, 1.0, table.p50)
        return cls((minimum, *inner, maximum))

    @property
    def mean(self) -> float:
        return _mean_of(list(self.knots))

    def quantile(self, probs: np.ndarray) -> np.ndarray:
        return np.exp(np.interp(probs, _KNOT_PROBS, np.log(self.knots)))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n integer lengths, at least 1 token."""
        values = np.rint(self.quantile(rng.random(n)))
        return np.maximum(values, 1).astype(np.int64)


def distribution(name: str, side: str) -> FittedLengths:
    """The fitted distribution for a Table 1 name (S, M, L, sharegpt, burstgpt) and side in/out."""
    assert side in ("in", "out")
    key = name.lower()
    if key in ("sharegpt", "burstgpt"):
        key = f"{key}-{side}"
    if key not in TABLE1:
        raise KeyError(name)
    return FittedLengths.fit(TABLE1[key])
