"""benchmarks/migration_sim.py end to end at its smallest (issue 20's benchmark): two simulated
llumlets, live migrations, and the stall the client saw, phase by phase. It broke once without
any test noticing (its recorder called the gateway's stall clock by an old signature)."""

from __future__ import annotations

import json

import pytest

from benchmarks.migration_sim import main

pytestmark = pytest.mark.slow  # (about half a minute: CI's `slow` run)


def test_a_tiny_run_reports_each_migration_stall_and_its_phases(tmp_path, capsys):
    out = tmp_path / "migration_sim.json"
    assert main(["--lengths", "256", "--repeats", "2", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    stall = document["live_client_stall_ms_by_length"]["256"]
    assert stall["runs"] == 2
    # a handover is at least the request's own gap between tokens (it misses no step), and the
    # simulated A10's decode step is ~34 ms: far from it, the clock timed something else
    assert 10.0 < stall["own_itl_median"] < 100.0
    assert stall["median"] >= 0.5 * stall["own_itl_median"]
    phases = document["live_stall_phases_ms_by_length"]["256"]
    assert {"dst_commit_to_in_engine", "dst_first_step"} <= set(phases)
    assert "client stall at the handover" in capsys.readouterr().out
