"""The benchmark's check of the issue's hard rule: every metric of the table, Corral against
INFaaS++, more than 10 % worse is a breach (preemption loss only above a floor)."""

from __future__ import annotations

from benchmarks.paper_repro import LOSS_FLOOR_S, breaches, pooled_ratio, seed_ratios


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
