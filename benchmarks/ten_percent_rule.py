"""The rule the Llumnix reproduction is judged by: Corral no more than 10 % worse than INFaaS++ on any
latency metric (and the preemption loss) at any load point, seed-averaged; with the per-seed
ratios, the control's own deviation and a bootstrap interval over seeds that tell a breach from
the chaos of a run near saturation. Shared by paper_repro.py, long_prompt_conv.py and decode_tail.py."""

from __future__ import annotations

import random


CONTROL = "infaas++ (control)"  # INFaaS++ with its load reports 0.2 % further apart


def average(runs: list[dict]) -> dict:
    """Field-wise mean of the numbers in structurally equal documents (the first's other values)."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: average([run[key] for run in runs if key in run]) for key in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(runs) / len(runs)
    return first


RULE_LIMIT = 1.10


CHECKED = (
    ("prefill", "mean_s", "mean prefill"), ("prefill", "p99_s", "P99 prefill"),
    ("decode", "mean_s", "mean decode"), ("decode", "p99_s", "P99 decode"),
    ("e2e", "mean_s", "mean e2e"), ("e2e", "p99_s", "P99 e2e"),
)


LOSS_FLOOR_S = 0.01  # a preemption loss this small a request is no regression, whatever the ratio


def metric_of(overall: dict, label: str) -> float:
    if label == "preemption loss":
        return overall["preemption_loss_mean_s"]
    group, stat, _ = next(c for c in CHECKED if c[2] == label)
    return overall[group][stat]


def breaches(corral: dict, infaas: dict) -> list[tuple[str, float]]:
    """(metric, Corral / INFaaS++) for every checked metric where Corral is over the limit."""
    found = []
    for _, _, label in (*CHECKED, (None, None, "preemption loss")):
        ours, base = metric_of(corral, label), metric_of(infaas, label)
        if label == "preemption loss" and ours - base <= LOSS_FLOOR_S:
            continue
        if ours > RULE_LIMIT * base:
            found.append((label, ours / base if base > 0 else float("inf")))
    return found


def seed_ratios(rows: dict[str, dict], label: str, policy: str = "corral") -> list[float]:
    """The metric's ratio to INFaaS++ seed by seed (the same workload for both)."""
    ours, base = rows[policy]["seeds"], rows["infaas++"]["seeds"]
    return [metric_of(ours[s]["overall"], label) / max(metric_of(base[s]["overall"], label), 1e-12) for s in ours]


def pooled_ratio(runs: list[dict], base_runs: list[dict], label: str) -> float:
    """Seed-averaged metric over seed-averaged metric, as the main table compares them."""
    ours = sum(metric_of(r["overall"], label) for r in runs) / len(runs)
    base = sum(metric_of(r["overall"], label) for r in base_runs) / len(base_runs)
    return ours / base if base > 0 else float("inf")


def annotate(violations: list[dict], rows: list[dict]) -> None:
    for v in violations:
        ours, base, control = (_seed_docs(rows, v, policy) for policy in ("corral", "infaas++", CONTROL))
        assert len(ours) == len(base) == len(control), v
        label = v["metric"]
        v["num_seeds_all"] = len(ours)
        v["ratio_all"] = pooled_ratio(ours, base, label)
        v["ratio_ci90"] = bootstrap_ratio_ci(ours, base, label)
        v["control_ratio"] = pooled_ratio(control, base, label)
        v["seed_ratios_all"] = [metric_of(a["overall"], label) / max(metric_of(b["overall"], label), 1e-12)
                                for a, b in zip(ours, base)]
        v["confirmed"] = v["ratio_all"] > RULE_LIMIT
        # The control's deviation from 1 is what chaos alone does to this metric at this point.
        noise = max(v["control_ratio"], 1 / v["control_ratio"]) if v["control_ratio"] > 0 else float("inf")
        v["beyond_control_noise"] = v["ratio_all"] > RULE_LIMIT * noise


def bootstrap_ratio_ci(runs: list[dict], base_runs: list[dict], label: str, draws: int = 2000,
                       level: float = 0.90) -> tuple[float, float]:
    """Confidence interval of the pooled ratio over the seeds drawn (seeds resampled in pairs,
    a fixed generator so that a report is reproducible): how much the verdict owes to which
    seeds happened to be run."""
    pairs = [(metric_of(a["overall"], label), metric_of(b["overall"], label)) for a, b in zip(runs, base_runs)]
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        base = sum(b for _, b in sample)
        ratios.append(sum(a for a, _ in sample) / base if base > 0 else float("inf"))
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * draws)], ratios[min(draws - 1, int((1 - tail) * draws))]


def _seed_docs(rows: list[dict], point: dict, policy: str) -> list[dict]:
    """A policy's per-seed metrics at a serving point, from the sweep and the confirmation."""
    return [
        doc for row in rows
        if row["section"] in ("serving", "confirm") and row["policy"] == policy
        and (row["trace"], row["rate"]) == (point["trace"], point["rate"])
        for doc in row["seeds"].values()
    ]
