"""benchmarks/pd.py: the split it picks, the verdicts it prints, its arguments, and a tiny run."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.pd import WorkloadArg, best_split, main, verdicts


def row(goodput: float, tbt: float, ttft: float = 1.0) -> dict:
    return {"goodput_rps": goodput, "tbt_p99_s": tbt, "ttft_p99_s": ttft}


def test_best_split_is_the_most_goodput_then_the_lowest_tbt():
    assert best_split({"a": row(10.0, 0.05), "b": row(11.0, 0.2)}) == "b"
    # within 0.5 % of the best goodput counts as a tie: the lower P99 TBT wins
    assert best_split({"a": row(10.0, 0.05), "b": row(10.04, 0.2)}) == "a"


def test_verdicts_read_the_direction_of_each_metric():
    lines = verdicts(row(12.0, 0.05, 1.0), row(10.0, 0.10, 1.02), "mixed")
    assert lines == ["goodput wins against mixed (+20%)", "P99 TTFT even with mixed (-2%)",
                     "P99 TBT wins against mixed (-50%)"]
    assert verdicts(row(9.0, 0.2, 2.0), row(10.0, 0.1, 1.0), "m")[2] == "P99 TBT loses against m (+100%)"


@pytest.mark.parametrize("text", ["x", "x=synthetic:L-S", "x=synthetic:L-S@", "x=synthetic:L-S@0", "=d@1"])
def test_bad_workload_arguments_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        WorkloadArg.parse(text)


def test_a_tiny_run_writes_every_system_and_the_sweep(tmp_path, capsys):
    out = tmp_path / "pd.json"
    assert main(["--instances", "3", "--requests", "40", "--seeds", "0,1", "--workload", "t=synthetic:L-S@4",
                 "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    [point] = document["points"]
    assert set(point["sweep"]) == {"P/D 1:2", "P/D 2:1"}
    assert point["best_split"] in point["sweep"]
    assert set(point["runs"]) == {point["best_split"], "corral", "infaas++"}
    assert all(len(rows) == 2 and all(r["completed"] == 40 for r in rows) for rows in point["runs"].values())
    assert "where P/D wins and loses" in capsys.readouterr().out
