"""PNG plots of a run: latency CDFs (log axes) and a timeline (arrivals, requests in flight,
outcomes with failures and rejections, output tokens/s). Every figure carries the run's title."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadgen.errors import LoadgenError
from loadgen.records import RequestRecord, RequestStatus

LOG_FLOOR_MS = 1e-3  # a 0 ms gap (chunks read together) still shows on a log axis
OUTCOME_COLORS = {RequestStatus.OK: "tab:green", RequestStatus.FAILED: "tab:red", RequestStatus.REJECTED: "tab:orange"}


def write_plots(records: Sequence[RequestRecord], directory: str | Path, title: str) -> list[Path]:
    """latency_cdf.png and timeline.png in `directory`, each titled `title`; the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display is assumed
    import matplotlib.pyplot as plt

    target = Path(directory).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoadgenError(f"cannot create plot directory {target}: {exc.strerror or exc}") from None
    return [
        save_figure(plt, latency_figure(plt, records, title), target / "latency_cdf.png"),
        save_figure(plt, timeline_figure(plt, records, title), target / "timeline.png"),
    ]


def latency_series_ms(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    """Sorted TTFT, TPOT, ITL and E2EL of the completed requests, in ms, floored for log axes."""
    done = [r for r in records if r.ok]
    series_s = {
        "TTFT": [r.ttft_s for r in done],
        "TPOT": [t for t in (r.tpot_s for r in done) if t is not None],
        "ITL": [gap for r in done for gap in r.itls_s],
        "E2EL": [r.e2el_s for r in done],
    }
    return {name: np.sort(np.maximum(np.asarray(v, dtype=float) * 1000.0, LOG_FLOOR_MS)) for name, v in series_s.items()}


def latency_figure(plt, records: Sequence[RequestRecord], title: str):
    """CDFs on log x axes: tails span orders of magnitude that a linear axis squashes."""
    from matplotlib import ticker

    not_done = sum(not r.ok for r in records)
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for axis, (name, values_ms) in zip(axes.flat, latency_series_ms(records).items()):
        if len(values_ms):
            axis.step(values_ms, np.arange(1, len(values_ms) + 1) / len(values_ms), where="post")
            axis.set_xscale("log")
            axis.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axis.xaxis.set_minor_formatter(minor_tick_formatter(values_ms[0], values_ms[-1]))
        axis.set_title(f"{name} CDF ({len(values_ms)} values)")
        axis.set_xlabel("ms (log scale)")
        axis.set_ylabel("fraction")
        axis.grid(alpha=0.3, which="both")
    note = f"; {not_done} request(s) failed or rejected, not in the CDFs" if not_done else ""
    figure.suptitle(f"{title}: latency CDFs of {len(records) - not_done} completed request(s){note}")
    return figure


def minor_tick_formatter(low_ms: float, high_ms: float):
    """Plain numbers on a log axis's minor ticks, fewer the more decades it spans: all of them
    within a decade (else it may show no label at all), 2s and 5s up to ~2.5 decades, none beyond."""
    from matplotlib import ticker

    decades = np.log10(high_ms / low_ms) if low_ms > 0 else np.inf
    shown = set(range(2, 10)) if decades < 1 else {2, 5} if decades < 2.5 else set()

    def label(value: float, _position: int) -> str:
        leading = int(round(value / 10 ** np.floor(np.log10(value) + 1e-9)))
        return f"{value:g}" if leading in shown else ""

    return ticker.FuncFormatter(label)


def timeline_figure(plt, records: Sequence[RequestRecord], title: str):
    end = max((r.end_s for r in records), default=0.0)
    width_s = timeline_bucket_s(end)
    figure, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    arrivals, inflight, outcomes, tokens = axes
    starts = bucket_starts(end, width_s)
    arrivals.bar(starts + width_s / 2, per_second([r.send_s for r in records], end, width_s), width=width_s)
    arrivals.set_ylabel("requests sent/s")
    times, in_flight = in_flight_steps(records)
    inflight.step(times, in_flight, where="post")
    inflight.set_ylabel("requests in flight")
    bottom = np.zeros(len(starts))
    for status, rate in outcome_rates(records, end, width_s).items():
        outcomes.bar(starts + width_s / 2, rate, width=width_s, bottom=bottom, color=OUTCOME_COLORS[status],
                     label=f"{status.value} ({sum(r.status is status for r in records)})")
        bottom += rate
    outcomes.set_ylabel("requests ended/s")
    outcomes.legend(fontsize=8, loc="upper left")
    chunks = [chunk for r in records for chunk in r.chunk_s]
    tokens.bar(starts + width_s / 2, per_second(chunks, end, width_s), width=width_s)
    tokens.set_ylabel("output tokens/s (chunks)")
    tokens.set_xlabel("seconds since start")
    for axis in axes:
        axis.grid(alpha=0.3)
    figure.suptitle(f"{title}: timeline ({width_s:.3g} s buckets)")
    return figure


def timeline_bucket_s(end_s: float) -> float:
    """One-second buckets, finer for runs under a minute so the plot still shows a shape."""
    return 1.0 if end_s >= 60 else max(end_s / 60, 0.01)


def bucket_starts(end_s: float, width_s: float) -> np.ndarray:
    return np.arange(max(int(np.ceil(end_s / width_s)), 1)) * width_s


def per_second(moments_s: Sequence[float], end_s: float, width_s: float) -> np.ndarray:
    """Events per second in each bucket of `width_s` from 0 to `end_s` (the last one closed)."""
    buckets = len(bucket_starts(end_s, width_s))
    counts = np.zeros(buckets)
    for moment in moments_s:
        counts[min(int(moment / width_s), buckets - 1)] += 1
    return counts / width_s


def outcome_rates(records: Sequence[RequestRecord], end_s: float, width_s: float) -> dict[RequestStatus, np.ndarray]:
    """Requests ending per second, by outcome (at the moment the stream closed or the error came)."""
    return {status: per_second([r.end_s for r in records if r.status is status], end_s, width_s) for status in RequestStatus}


def in_flight_steps(records: Sequence[RequestRecord]) -> tuple[list[float], list[int]]:
    events = sorted([(r.send_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    times, counts, current = [0.0], [0], 0
    for moment, step in events:
        current += step
        times.append(moment)
        counts.append(current)
    return times, counts


def save_figure(plt, figure, path: Path, dpi: int = 100) -> Path:
    """Write and close a matplotlib figure; an unwritable path is a LoadgenError."""
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=dpi)
    except OSError as exc:
        raise LoadgenError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
    return path
