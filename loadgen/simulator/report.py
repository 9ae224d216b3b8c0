"""Results of simulated runs: a text table, a JSON document, PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loadgen.errors import LoadgenError
from loadgen.plots import save_figure
from loadgen.simulator.cluster import SimResult
from loadgen.simulator.metrics import ClassMetrics, RequestLatencies, RunMetrics


@dataclass(frozen=True)
class RunRecord:
    """One policy at one load point: its metrics plus what the plots need."""

    rate: float | None
    metrics: RunMetrics
    latencies: RequestLatencies
    result: SimResult

    @property
    def policy(self) -> str:
        return self.metrics.policy


# -- table -------------------------------------------------------------------------------------

_HEADER = (
    f"{'policy':<13} {'prefill mean':>12} {'P99':>8} {'decode mean':>11} {'P99':>7} {'e2e mean':>9} {'P99':>8} "
    f"{'preempt loss':>12} {'#preempt':>8} {'#migr':>6} {'inst-h':>6}"
)


def _row(name: str, m: ClassMetrics) -> str:
    return (
        f"{name:<13} {m.prefill.mean_s:>11.2f}s {m.prefill.p99_s:>7.2f}s {m.decode.mean_s * 1e3:>9.1f}ms "
        f"{m.decode.p99_s * 1e3:>5.0f}ms {m.e2e.mean_s:>8.1f}s {m.e2e.p99_s:>7.1f}s {m.preemption_loss_mean_s:>11.3f}s"
    )


def format_table(records: Sequence[RunRecord]) -> str:
    """One block per load point; per-class rows when the workload has high-priority requests."""
    lines = []
    for rate in dict.fromkeys(r.rate for r in records):
        group = [r for r in records if r.rate == rate]
        lines.append(f"\n{group[0].metrics.workload}" + (f"  [rate {rate:g} req/s]" if rate is not None else ""))
        lines.append(_HEADER)
        for record in group:
            m = record.metrics
            lines.append(
                f"{_row(m.policy, m.overall)} {m.num_preemptions:>8} {m.migrations['committed']:>6} "
                f"{m.instance_hours:>6.2f}"
            )
            if "high" in m.by_class:
                for name, cls in m.by_class.items():
                    lines.append(_row(f"  {name}", cls))
            if m.rejected:
                lines.append(f"  {m.rejected} request(s) rejected")
    return "\n".join(lines)


# -- JSON --------------------------------------------------------------------------------------


def results_document(records: Sequence[RunRecord], settings: dict) -> dict:
    return {
        "settings": settings,
        "runs": [
            {
                "rate": record.rate,
                **record.metrics.to_json(),
                "scaling_events": [asdict(e) for e in record.result.scaling_events],
                "timeline": record.result.timeline.to_json(),
            }
            for record in records
        ],
    }


def write_json(path: str | Path, document: dict) -> Path:
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(document, indent=1, default=_jsonable) + "\n")
    except OSError as exc:
        raise LoadgenError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return str(value)


# -- plots -------------------------------------------------------------------------------------


def write_plots(records: Sequence[RunRecord], directory: str | Path) -> list[Path]:
    """latency_cdf[_rateR].png per load point, timeline_POLICY[_rateR].png per run, and
    sweep.png (P99 against rate) when there are several load points."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display is assumed
    import matplotlib.pyplot as plt

    target = Path(directory).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoadgenError(f"cannot create plot directory {target}: {exc.strerror or exc}") from None
    rates = list(dict.fromkeys(r.rate for r in records))
    written = []
    for rate in rates:
        suffix = f"_rate{rate:g}" if len(rates) > 1 and rate is not None else ""
        group = [r for r in records if r.rate == rate]
        written.append(_latency_cdfs(plt, group, target / f"latency_cdf{suffix}.png"))
        for record in group:
            name = record.policy.replace("+", "p")
            written.append(_timeline(plt, record, target / f"timeline_{name}{suffix}.png"))
    if len(rates) > 1 and None not in rates:
        written.append(_sweep(plt, records, target / "sweep.png"))
    return written


def _latency_cdfs(plt, group: Sequence[RunRecord], path: Path) -> Path:
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for axis, (title, field, scale, unit) in zip(
        axes,
        (("prefill latency (TTFT)", "prefill_s", 1.0, "s"), ("decode latency", "decode_s", 1e3, "ms"),
         ("end-to-end latency", "e2e_s", 1.0, "s")),
    ):
        for record in group:
            values = np.sort(np.asarray(getattr(record.latencies, field)) * scale)
            if len(values):
                axis.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=record.policy)
        # Tails span orders of magnitude (round-robin queues for minutes): log axes show both ends.
        axis.set_xscale("symlog", linthresh=0.1) if field == "prefill_s" else axis.set_xscale("log")
        axis.set_title(title)
        axis.set_xlabel(unit)
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(group[0].metrics.workload + (f" @ {group[0].rate:g} req/s" if group[0].rate else ""))
    return save_figure(plt, figure, path, dpi=90)


def _timeline(plt, record: RunRecord, path: Path) -> Path:
    t = record.result.timeline
    figure, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    top.step(t.times_s, t.live, where="post", label="live")
    top.step(t.times_s, t.draining, where="post", label="draining")
    top.step(t.times_s, t.starting, where="post", label="starting")
    top.set_ylabel("instances")
    top.legend(fontsize=8)
    middle.plot(t.times_s, t.running, label="running")
    middle.plot(t.times_s, t.waiting, label="waiting")
    middle.plot(t.times_s, t.migrations_in_flight, label="migrations in flight")
    middle.set_ylabel("requests")
    middle.legend(fontsize=8)
    bottom.plot(t.times_s, t.used_fraction, label="cluster")
    ids = sorted({iid for sample in t.per_instance_used for iid in sample})
    for iid in ids:
        bottom.plot(t.times_s, [s.get(iid, np.nan) for s in t.per_instance_used], lw=0.4, alpha=0.5)
    bottom.set_ylabel("KV blocks used (fraction)")
    bottom.set_xlabel("virtual time (s)")
    for axis in (top, middle, bottom):
        axis.grid(alpha=0.3)
    at_rate = f" @ {record.rate:g} req/s" if record.rate else ""
    figure.suptitle(f"{record.policy}: {record.metrics.workload}{at_rate}")
    return save_figure(plt, figure, path, dpi=90)


def _sweep(plt, records: Sequence[RunRecord], path: Path) -> Path:
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    panels = (
        ("P99 prefill (s)", lambda m: m.overall.prefill.p99_s),
        ("P99 decode (ms)", lambda m: m.overall.decode.p99_s * 1e3),
        ("P99 end-to-end (s)", lambda m: m.overall.e2e.p99_s),
        ("mean preemption loss (s)", lambda m: m.overall.preemption_loss_mean_s),
    )
    for axis, (title, value) in zip(axes, panels):
        for policy in dict.fromkeys(r.policy for r in records):
            points = sorted((r.rate, value(r.metrics)) for r in records if r.policy == policy)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        axis.set_title(title)
        axis.set_xlabel("request rate (req/s)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return save_figure(plt, figure, path, dpi=90)
