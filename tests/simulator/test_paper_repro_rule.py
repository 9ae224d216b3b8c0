"""The benchmark's check of the issue's hard rule: every metric of the table, Corral against
INFaaS++, more than 10 % worse is a breach (preemption loss only above a floor)."""

from __future__ import annotations

from benchmarks.ten_percent_rule import (
    CONTROL, LOSS_FLOOR_S, annotate, bootstrap_ratio_ci, breaches, pooled_ratio, seed_ratios,
)


def overall(prefill=(1.0, 10.0), decode=(0.05, 0.2), e2e=(20.0, 100.0), loss=0.0) -> dict:
    def stats(mean_p99):
        return {"mean_s": mean_p99[0], "p99_s": mean_p99[1]}

    return {"prefill": stats(prefill), "decode": stats(decode), "e2e": stats(e2e), "preemption_loss_mean_s": loss}


def test_every_latency_metric_is_checked_means_included():
    base = overall()
    assert breaches(overall(), base) == []
    assert breaches(overall(prefill=(1.05, 10.9)), base) == []  # within 10 %
    found = dict(breaches(overall(prefill=(1.2, 10.0), decode=(0.05, 0.23), e2e=(20.0, 111.0)), base))
    assert found.keys() == {"mean prefill", "P99 decode", "P99 e2e"}
    assert abs(found["P99 decode"] - 1.15) < 1e-9


def test_preemption_loss_counts_only_above_its_floor():
    assert breaches(overall(loss=0.005), overall(loss=0.001)) == []  # 5x, but a few ms
    found = dict(breaches(overall(loss=0.5), overall(loss=0.2)))
    assert found == {"preemption loss": 0.5 / 0.2}
    assert breaches(overall(loss=LOSS_FLOOR_S * 2), overall(loss=0.0))  # from nothing to something


def test_ratios_are_paired_by_seed_and_pooled_like_the_table():
    rows = {
        "corral": {"seeds": {"0": {"overall": overall(decode=(0.05, 0.3))}, "1": {"overall": overall(decode=(0.05, 0.1))}}},
        "infaas++": {"seeds": {"0": {"overall": overall(decode=(0.05, 0.2))}, "1": {"overall": overall(decode=(0.05, 0.2))}}},
    }
    assert [round(r, 6) for r in seed_ratios(rows, "P99 decode")] == [1.5, 0.5]
    pooled = pooled_ratio(list(rows["corral"]["seeds"].values()), list(rows["infaas++"]["seeds"].values()), "P99 decode")
    assert abs(pooled - 1.0) < 1e-9


def seed_docs(values: list[float]) -> list[dict]:
    return [{"overall": overall(prefill=(value, 10.0))} for value in values]


def test_bootstrap_interval_brackets_the_pooled_ratio():
    ours, base = seed_docs([1.0, 3.0, 0.5, 2.0]), seed_docs([1.0, 1.0, 1.0, 1.0])
    low, high = bootstrap_ratio_ci(ours, base, "mean prefill")
    assert low < pooled_ratio(ours, base, "mean prefill") < high
    assert (low, high) == bootstrap_ratio_ci(ours, base, "mean prefill")  # reproducible


def test_bootstrap_interval_is_tight_when_every_seed_agrees():
    low, high = bootstrap_ratio_ci(seed_docs([1.2] * 8), seed_docs([1.0] * 8), "mean prefill")
    assert abs(low - 1.2) < 1e-9 and abs(high - 1.2) < 1e-9


def row(section: str, policy: str, values: list[float], first_seed: int) -> dict:
    seeds = {str(first_seed + i): doc for i, doc in enumerate(seed_docs(values))}
    return {"section": section, "policy": policy, "trace": "S-L", "rate": 7.0, "seeds": seeds}


def test_a_breach_is_judged_on_all_the_seeds_of_its_point():
    rows = [
        row("serving", "corral", [1.5, 1.5], 0), row("serving", "infaas++", [1.0, 1.0], 0),
        row("confirm", CONTROL, [1.0, 1.0], 0),
        # the confirmation seeds, then the escalation's: the breach fades with more data
        row("confirm", "corral", [1.0] * 6, 2), row("confirm", "infaas++", [1.0] * 6, 2),
        row("confirm", CONTROL, [1.0] * 6, 2),
        row("serving", "corral", [9.0], 0) | {"trace": "L-L"},  # another point: ignored
    ]
    breach = {"trace": "S-L", "rate": 7.0, "metric": "mean prefill"}
    annotate([breach], rows)
    assert breach["num_seeds_all"] == 8 and abs(breach["ratio_all"] - 9.0 / 8.0) < 1e-9
    assert breach["confirmed"] and breach["beyond_control_noise"]
    rows += [row("confirm", "corral", [1.0] * 24, 8), row("confirm", "infaas++", [1.0] * 24, 8),
             row("confirm", CONTROL, [1.0] * 24, 8)]
    annotate([breach], rows)
    assert breach["num_seeds_all"] == 32 and not breach["confirmed"]
