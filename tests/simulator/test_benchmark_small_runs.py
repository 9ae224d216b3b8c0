"""Benchmarks at their smallest: each runs to its end, or says why it cannot (a smoke run of
every script found two that had rotted without a test noticing)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import benchmarks.admission as admission
from benchmarks import dispatch_cost
from loadgen.simulator.workload import SimArrival, Workload
from shared.policy.admission import Slo, SloConfig


def test_dispatch_cost_runs_and_its_index_decides_as_the_scan(tmp_path):
    # was: a TypeError on its first report (the fleet impersonator's report() gained a heartbeat)
    out = tmp_path / "dispatch_cost.json"
    assert dispatch_cost.main(["--instances", "16", "--dispatches", "100", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["instances"] == 16 and row["same_decisions"]


def _arrivals_at(rate: float, count: int = 50) -> Workload:
    return Workload([SimArrival(i, i / rate, 100, 10, 0) for i in range(count)], f"{count} at {rate:g}/s")


def test_the_saturation_search_ends_where_no_rate_can_load_a_small_workload_more(monkeypatch):
    # was: with too few requests it searched higher rates for ever
    slo = SloConfig(Slo(3.0, 0.2))
    monkeypatch.setattr(admission, "simulate", lambda *args: None)
    monkeypatch.setattr(admission, "slo_metrics", lambda result, slo: SimpleNamespace(accepted_ttft_p99_s=2.0))
    with pytest.raises(admission.TooSmallToSaturate, match="raise --requests"):
        admission.saturating_rate(None, _arrivals_at, slo)


def test_the_saturation_search_finds_the_rate_where_the_slo_breaks(monkeypatch):
    slo = SloConfig(Slo(3.0, 0.2))
    offered: list[float] = []

    def workload_at(rate: float) -> Workload:
        offered.append(rate)
        return _arrivals_at(rate)

    monkeypatch.setattr(admission, "simulate", lambda config, workload, *args: workload)
    monkeypatch.setattr(admission, "slo_metrics", lambda workload, slo: SimpleNamespace(
        accepted_ttft_p99_s=5.0 if offered[-1] > 2.0 else 1.0))
    assert admission.saturating_rate(None, workload_at, slo) == 2.0


def test_the_stall_logging_gateway_answers_help_instead_of_logging_to_a_file_named_help(monkeypatch, tmp_path,
                                                                                       capsys):
    from benchmarks import loop_stalls

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["loop_stalls", "--help"])
    assert loop_stalls.main() == 0
    monkeypatch.setattr("sys.argv", ["loop_stalls"])
    assert loop_stalls.main() == 2
    assert "STALL_LOG" in capsys.readouterr().err and not list(tmp_path.iterdir())
