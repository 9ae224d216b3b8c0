"""Arrival processes: mean and CV of the gaps, trace replay, priorities."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.arrivals import arrival_times, priority_flags


def _gaps(times: list[float]) -> np.ndarray:
    return np.diff([0.0, *times])


def test_poisson_gaps_have_mean_one_over_rate_and_cv_one() -> None:
    gaps = _gaps(arrival_times("poisson", 20000, rate=4.0, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_gaps_have_the_requested_cv(cv: float) -> None:
    gaps = _gaps(arrival_times("gamma", 40000, rate=10.0, cv=cv, seed=2))
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_same_seed_same_times() -> None:
    assert arrival_times("gamma", 50, 2.0, 2.0, seed=7) == arrival_times("gamma", 50, 2.0, 2.0, seed=7)
    assert arrival_times("gamma", 50, 2.0, 2.0, seed=7) != arrival_times("gamma", 50, 2.0, 2.0, seed=8)


def test_match_total_duration_ends_at_n_over_rate() -> None:
    times = arrival_times("poisson", 100, rate=5.0, seed=3, match_total_duration=True)
    assert times[-1] == pytest.approx(20.0)
    assert times == sorted(times)


def test_trace_times_are_relative_and_scaled() -> None:
    times = arrival_times("trace", 3, trace_timestamps=[10.0, 12.0, 16.0, 99.0], time_scale=0.5)
    assert times == [0.0, 1.0, 3.0]


def test_trace_without_timestamps_is_refused() -> None:
    with pytest.raises(ValueError, match="timestamp"):
        arrival_times("trace", 2, trace_timestamps=[1.0, None])


def test_burst_and_infinite_rate_send_everything_at_once() -> None:
    assert arrival_times("burst", 3) == [0.0, 0.0, 0.0]
    assert arrival_times("poisson", 2, rate=math.inf) == [0.0, 0.0]


def test_priority_fraction_is_exact_and_seeded() -> None:
    flags = priority_flags(1000, 0.3, seed=1)
    assert sum(flags) == 300
    assert flags == priority_flags(1000, 0.3, seed=1)
    assert flags != priority_flags(1000, 0.3, seed=2)
    assert sum(priority_flags(10, 0.0, seed=1)) == 0
