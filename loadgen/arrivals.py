"""Arrival processes (BENCHMARKS.md): Poisson, Gamma with a CV, trace timestamps, all-at-once.

Pure functions of their arguments: the runner and the simulator call the same code, and the same
seed always gives the same times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ARRIVAL_KINDS = ("poisson", "gamma", "trace", "burst")


def gamma_gaps(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """n inter-arrival gaps with mean 1/rate: Gamma(shape = 1/CV², scale = CV²/rate).

    CV = 1 is the exponential (Poisson process); a larger CV is burstier.
    """
    assert rate > 0 and math.isfinite(rate), rate
    assert cv > 0, cv
    shape = 1.0 / cv**2
    scale = cv**2 / rate
    return rng.gamma(shape, scale, size=n)


def arrival_times(
    kind: str,
    n: int,
    rate: float = math.inf,
    cv: float = 1.0,
    seed: int = 0,
    *,
    trace_timestamps: Sequence[float | None] | None = None,
    time_scale: float = 1.0,
    match_total_duration: bool = False,
) -> list[float]:
    """Send times in seconds from the benchmark start, non-decreasing, one per request.

    - poisson / gamma: the first request waits one gap, like a process started at 0.
      `match_total_duration` rescales the times so the last arrival lands at n/rate, as
      `vllm bench serve` does to steady throughput across seeds (the CV is unchanged).
    - trace: the trace's own timestamps relative to its first one, times `time_scale`
      (0.5 replays twice as fast).
    - burst: everything at 0 (a fixed concurrency is then set by the caller's cap).
    """
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if kind == "burst" or (kind in ("poisson", "gamma") and math.isinf(rate)):
        return [0.0] * n
    if kind in ("poisson", "gamma"):
        if not rate > 0:
            raise ValueError(f"request rate must be > 0, got {rate}")
        gaps = gamma_gaps(n, rate, 1.0 if kind == "poisson" else cv, np.random.default_rng(seed))
        times = np.cumsum(gaps)
        if match_total_duration and n and times[-1] > 0:
            times *= (n / rate) / times[-1]
        return times.tolist()
    if kind == "trace":
        return _trace_times(trace_timestamps, n, time_scale)
    raise ValueError(f"unknown arrival kind {kind!r}; expected one of {', '.join(ARRIVAL_KINDS)}")


def _trace_times(timestamps: Sequence[float | None] | None, n: int, time_scale: float) -> list[float]:
    if timestamps is None or len(timestamps) < n or any(t is None for t in timestamps[:n]):
        raise ValueError("trace arrivals need a dataset with a timestamp on every request")
    if not time_scale > 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    if n == 0:
        return []
    first = min(timestamps[:n])
    times = [(t - first) * time_scale for t in timestamps[:n]]
    # Traces are in time order; keep the schedule monotone even if a few rows are not.
    return np.maximum.accumulate(times).tolist()


def priority_flags(n: int, fraction: float, seed: int) -> list[bool]:
    """Which requests are high priority: exactly round(fraction*n) of them, chosen by the seed."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"priority fraction must be within [0, 1], got {fraction}")
    rng = np.random.default_rng([seed, 1])  # a stream apart from the arrivals' own
    chosen = rng.permutation(n)[: round(fraction * n)]
    flags = np.zeros(n, dtype=bool)
    flags[chosen] = True
    return flags.tolist()
