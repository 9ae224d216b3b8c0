"""PNG plots of a run: latency CDFs and a timeline (requests in flight, output tokens/s)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadgen.errors import LoadgenError
from loadgen.records import RequestRecord


def write_plots(records: Sequence[RequestRecord], directory: str | Path) -> list[Path]:
    """latency_cdf.png and timeline.png in `directory`; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display is assumed
    import matplotlib.pyplot as plt

    target = Path(directory).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LoadgenError(f"cannot create plot directory {target}: {exc.strerror or exc}") from None
    written = [_latency_cdfs(plt, records, target / "latency_cdf.png")]
    written.append(_timeline(plt, records, target / "timeline.png"))
    return written


def _latency_cdfs(plt, records: Sequence[RequestRecord], path: Path) -> Path:
    done = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft_s for r in done],
        "TPOT": [t for t in (r.tpot_s for r in done) if t is not None],
        "ITL": [gap for r in done for gap in r.itls_s],
        "E2EL": [r.e2el_s for r in done],
    }
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for axis, (name, values_s) in zip(axes.flat, series.items()):
        if values_s:
            values_ms = np.sort(np.asarray(values_s) * 1000.0)
            axis.step(values_ms, np.arange(1, len(values_ms) + 1) / len(values_ms), where="post")
        axis.set_title(f"{name} CDF ({len(values_s)} values)")
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction")
        axis.grid(alpha=0.3)
    return save_figure(plt, figure, path)


def _timeline(plt, records: Sequence[RequestRecord], path: Path) -> Path:
    end = max((r.end_s for r in records), default=0.0)
    width_s = timeline_bucket_s(end)
    buckets = max(int(np.ceil(end / width_s)), 1)
    chunks = np.zeros(buckets)
    for record in records:
        for chunk in record.chunk_s:
            chunks[min(int(chunk / width_s), buckets - 1)] += 1
    times, in_flight = in_flight_steps(records)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.step(times, in_flight, where="post")
    top.set_ylabel("requests in flight")
    top.grid(alpha=0.3)
    bottom.bar((np.arange(buckets) + 0.5) * width_s, chunks / width_s, width=width_s)
    bottom.set_ylabel("output tokens/s (chunks)")
    bottom.set_xlabel("seconds since start")
    bottom.grid(alpha=0.3)
    return save_figure(plt, figure, path)


def timeline_bucket_s(end_s: float) -> float:
    """One-second buckets, finer for runs under a minute so the plot still shows a shape."""
    return 1.0 if end_s >= 60 else max(end_s / 60, 0.01)


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
