"""The prefix-dispatch benchmark's target checks (benchmarks/prefix_dispatch.py): the verdicts it
prints per seed and seed-averaged, and where it puts the load at which the cache matters."""

from __future__ import annotations

from benchmarks.prefix_dispatch import target_checks

SLO_S = 5.0


def row(policy: str, rate: float, seed: int, p99: float, hit: float = 0.0) -> dict:
    return {"workload": "conv", "rate": rate, "seed": seed, "policy": policy, "ttft_p99_s": p99, "hit_rate": hit}


def sweep(ours_at_knee: tuple[float, float]) -> list[dict]:
    """Two rates, two seeds: the load-only policies break the SLO at 3/s, not at 2/s."""
    runs = []
    for seed, ours in enumerate(ours_at_knee):
        runs += [row("llumnix-base", 2, seed, 2.0), row("prefix-only", 2, seed, 6.0, hit=0.40),
                 row("corral-prefix", 2, seed, 1.9, hit=0.38)]
        runs += [row("llumnix-base", 3, seed, 10.0), row("prefix-only", 3, seed, 30.0, hit=0.40),
                 row("corral-prefix", 3, seed, ours, hit=0.30)]
    return runs


def line_at(lines: list[str], rate: str) -> str:
    return next(line for line in lines if line.strip().startswith(rate))


def test_the_knee_is_where_load_only_dispatch_first_breaks_the_slo():
    lines = target_checks(sweep((4.0, 4.0)), SLO_S)
    assert "the cache matters (best load-only P99 TTFT > SLO 5s): 3/s" in lines[0]
    assert "past saturation at 3/s (every policy's P99 TTFT > SLO): NO" in lines[0]  # ours is 4 s
    assert "(2)" not in line_at(lines, "2/s")  # only at the knee


def test_each_target_is_judged_per_seed_and_on_the_seed_mean():
    knee = line_at(target_checks(sweep((4.0, 6.0)), SLO_S), "3/s")
    s0, rest = knee.split("s1:")
    s1, mean = rest.split("mean:")
    assert "(2) ok 2.50x" in s0 and "(2) MISSED 1.67x" in s1 and "(2) ok 2.00x" in mean
    assert "(1) ok" in s0 and "(1) ok" in s1
    # hit rate 30 % against prefix-only's 40 %: missed everywhere; its P99 is 5-7.5x ours: met
    assert all("hit 30.0%/40.0% MISSED" in part for part in (s0, s1, mean))
    assert "P99 7.50x ok" in s0 and "P99 5.00x ok" in s1


def test_being_slower_than_another_policy_is_reported():
    runs = sweep((4.0, 4.0)) + [row("kv-cost", 2, s, 1.0) for s in (0, 1)]
    assert "(1) MISSED 1.90x" in line_at(target_checks(runs, SLO_S), "2/s")
