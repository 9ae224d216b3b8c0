"""Plots: log latency axes, failures and rejections in the timeline, an arrival-rate panel, and the
run's title on every figure."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from loadgen.client import EndpointConfig  # noqa: E402
from loadgen.plots import latency_figure, outcome_rates, per_second, timeline_figure, write_plots  # noqa: E402
from loadgen.records import RequestRecord, RequestStatus  # noqa: E402
from loadgen.runner import BenchmarkConfig, run_title  # noqa: E402
from loadgen.schedule import SchedulePlan  # noqa: E402


def _records() -> list[RequestRecord]:
    ok = [RequestRecord(i, 4, 4, send_s=0.5 * i, chunk_s=[0.5 * i + 0.01, 0.5 * i + 0.01, 0.5 * i + 2.0],
                        end_s=0.5 * i + 2.0, status=RequestStatus.OK) for i in range(6)]
    failed = [RequestRecord(6, 4, 4, send_s=1.0, end_s=1.2, error="engine died")]
    rejected = [RequestRecord(7 + i, 4, 4, send_s=2.0, end_s=2.01, status=RequestStatus.REJECTED) for i in range(2)]
    return ok + failed + rejected


def test_latency_axes_are_logarithmic_and_titled() -> None:
    figure = latency_figure(plt, _records(), "my run")
    try:
        axes = figure.axes
        assert [a.get_xscale() for a in axes] == ["log"] * 4
        itl_line = axes[2].lines[0].get_xdata()
        assert min(itl_line) > 0  # the 0 ms gap is floored, not dropped by the log axis
        title = figure._suptitle.get_text()
        assert title.startswith("my run:") and "3 request(s) failed or rejected" in title
    finally:
        plt.close(figure)


def test_timeline_shows_arrivals_outcomes_and_the_title() -> None:
    records = _records()
    figure = timeline_figure(plt, records, "my run")
    try:
        labels = [a.get_ylabel() for a in figure.axes]
        assert labels == ["requests sent/s", "requests in flight", "requests ended/s", "output tokens/s (chunks)"]
        legend = [t.get_text() for t in figure.axes[2].get_legend().get_texts()]
        assert legend == ["ok (6)", "failed (1)", "rejected (2)"]
        assert figure._suptitle.get_text().startswith("my run: timeline")
    finally:
        plt.close(figure)


def test_rates_per_bucket_count_every_request() -> None:
    records = _records()
    width = 0.5
    end = max(r.end_s for r in records)
    arrivals = per_second([r.send_s for r in records], end, width)
    assert arrivals.sum() * width == len(records)
    rates = outcome_rates(records, end, width)
    assert {s: round(r.sum() * width) for s, r in rates.items()} == {
        RequestStatus.OK: 6, RequestStatus.FAILED: 1, RequestStatus.REJECTED: 2}
    assert rates[RequestStatus.REJECTED][int(2.01 / width)] == pytest.approx(2 / width)
    assert np.all(per_second([end], end, width)[-1] == 1 / width)  # the last moment lands in the last bucket


def test_write_plots_and_the_default_title(tmp_path) -> None:
    paths = write_plots(_records(), tmp_path / "plots", "t")
    assert sorted(p.name for p in paths) == ["latency_cdf.png", "timeline.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    config = BenchmarkConfig(EndpointConfig("http://h", "m"), "random:5:4", SchedulePlan(arrival="poisson", rate=2.0))
    assert run_title(config) == "m, random:5:4, 2 req/s"
    assert run_title(BenchmarkConfig(EndpointConfig("http://h", "m"), "random:5:4", label="x")) == "x"


def test_minor_ticks_are_labelled_less_the_wider_the_axis() -> None:
    from loadgen.plots import minor_tick_formatter

    within_a_decade = minor_tick_formatter(45.0, 100.0)
    assert [within_a_decade(v, 0) for v in (50.0, 70.0, 90.0)] == ["50", "70", "90"]
    two_decades = minor_tick_formatter(20.0, 600.0)
    assert [two_decades(v, 0) for v in (20.0, 30.0, 50.0, 0.2)] == ["20", "", "50", "0.2"]
    six_decades = minor_tick_formatter(0.001, 2000.0)
    assert six_decades(50.0, 0) == ""
