"""Admission control in the simulator (issue 19): early rejection against an SLO, the SLO table."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from loadgen.errors import LoadgenError
from loadgen.simulator import cli
from loadgen.simulator.admission import AdmissionModel
from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.slo import per_second, slo_metrics
from loadgen.simulator.workload import SimArrival, Workload, WorkloadSpec, build_workload
from shared.policy.admission import AdmissionPolicy, Slo, SloConfig
from shared.policy.baselines import get_policy
from tests.simulator.helpers import workload_of

SLO = SloConfig(Slo(ttft_s=3.0, tbt_s=0.08))


def run(policy: AdmissionPolicy, rate: float = 5.0, n: int = 300):
    config = SimConfig(num_instances=3, admission=AdmissionModel(policy, SLO))
    workload = build_workload(WorkloadSpec("synthetic:sharegpt", num_requests=n, rate=rate, seed=1), config.max_seq_len)
    return ClusterSimulator(config, get_policy("corral"), workload).run()


def test_overload_without_admission_misses_the_slo_and_with_it_rejects_early():
    none, predicted = run(AdmissionPolicy.NONE), run(AdmissionPolicy.PREDICTED)
    m_none, m_pred = slo_metrics(none, SLO), slo_metrics(predicted, SLO)
    assert m_none.rejected == 0 and m_none.accepted_ttft_p99_s > 10 * SLO.default.ttft_s
    assert m_pred.rejected > 0 and m_pred.accepted + m_pred.rejected == 300
    assert m_pred.goodput_rps > 1.5 * m_none.goodput_rps
    assert m_pred.wasted_prefill_share < m_none.wasted_prefill_share
    # The prediction's error bounds how far past the target an accepted request lands.
    assert m_pred.accepted_ttft_p99_s <= SLO.default.ttft_s + 1.0
    assert set(predicted.predicted_ttft_s) == {r.request_id for r in predicted.finished}  # one per admitted
    assert not none.predicted_ttft_s and m_none.ttft_prediction_error_p99_s == 0.0
    errors = sorted(r.first_token_time - r.arrival_time - predicted.predicted_ttft_s[r.request_id]
                    for r in predicted.finished)
    assert m_pred.ttft_prediction_error_p50_s == pytest.approx(errors[len(errors) // 2], abs=0.5)
    # Each was admitted on a prediction within its SLO: it misses by at most its own prediction's error.
    assert m_pred.worst_ttft_miss_s <= errors[-1] + 1e-9
    assert all(r.rejected.startswith("overloaded:") for r in predicted.rejected)
    accepted, rejected = per_second(predicted)
    assert sum(accepted) == m_pred.accepted and sum(rejected) == m_pred.rejected


def test_below_saturation_nothing_is_rejected():
    m = slo_metrics(run(AdmissionPolicy.PREDICTED, rate=0.5, n=60), SLO)
    assert m.rejected == 0 and m.met_slo == 60


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loadgen")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["simulate", *argv])


def test_cli_prints_and_writes_the_slo_table(tmp_path, capsys):
    args = parse("--dataset", "synthetic:sharegpt", "--num-requests", "80", "--rate", "6", "--instances", "2",
                 "--policy", "corral", "--admission", "current-load", "--slo-ttft-s", "2", "--slo-tbt-s", "0.1",
                 "--out", str(tmp_path / "r.json"), "--quiet")
    assert args.handler(args) == 0
    assert "goodput" in capsys.readouterr().out
    slo = json.loads((tmp_path / "r.json").read_text())["slo"]
    assert slo[0]["accepted"] + slo[0]["rejected"] == 80


@pytest.mark.parametrize("argv", [
    ("--admission", "predicted"),  # no SLO
    ("--slo-ttft-s", "2"),  # half an SLO
    ("--admission", "predicted", "--slo-ttft-s", "0", "--slo-tbt-s", "0.1"),
    ("--admission", "predicted", "--slo-ttft-s", "2", "--slo-tbt-s", "0.1", "--slo-priority", "high:0.5"),
])
def test_bad_admission_options_are_clear_errors(argv):
    args = parse("--dataset", "synthetic:sharegpt", "--num-requests", "10", *argv)
    with pytest.raises(LoadgenError):
        cli.build_config(args)


def test_a_priority_slo_flag_reaches_the_simulated_admission():
    args = parse("--dataset", "synthetic:sharegpt", "--num-requests", "10", "--admission", "predicted",
                 "--slo-ttft-s", "2", "--slo-tbt-s", "0.1", "--slo-priority", "high:0.5:0.05")
    slo = cli.build_config(args).admission.slo
    assert slo.slo_for(-1) == Slo(0.5, 0.05) and slo.slo_for(0) == Slo(2, 0.1)


def test_a_burst_does_not_leave_its_pace_behind_to_refuse_the_next_one():
    """As the live benchmark `admission_live` found: a burst of long prompts slows the steps that
    mix prefill in; once the instances are idle that pace must not price the next burst's empty
    batches, or nothing is ever admitted again (no step runs to update it)."""
    slo = SloConfig(Slo(ttft_s=1.0, tbt_s=0.038))  # room for the first burst, not at its leftover pace
    burst = [(0.01 * i, 1000, 32, 0) for i in range(20)]
    later = [(30.0 + 0.01 * i, 1000, 32, 0) for i in range(20)]
    config = SimConfig(num_instances=2, admission=AdmissionModel(AdmissionPolicy.PREDICTED, slo))
    result = ClusterSimulator(config, get_policy("corral"), workload_of(burst + later)).run()
    admitted = [int(r.request_id.removeprefix("r")) for r in result.finished]
    first, second = [i for i in admitted if i < 20], [i for i in admitted if i >= 20]
    assert first and len(second) == len(first)  # the same room again
    assert len(result.rejected) == 40 - len(admitted)


def test_a_cached_prefix_is_not_predicted_as_prefill():
    # One instance; three prompts sharing two 512-token trace blocks, far apart: the second and
    # third find 1,024 of their 1,100 tokens cached, and the prediction (what admission told the
    # gateway) is their actual TTFT, not the whole prompt's prefill (~0.3 s more on an A10).
    rows = [SimArrival(i, 5.0 * i, 1100, 4, 0, hash_ids=(7, 8, 100 + i)) for i in range(3)]
    base = SimConfig(num_instances=1, admission=AdmissionModel(AdmissionPolicy.PREDICTED, SLO))
    config = replace(base, scheduler=replace(base.scheduler, enable_prefix_caching=True, max_model_len=16384))
    result = ClusterSimulator(config, get_policy("corral-prefix"), Workload(rows, "hand-made")).run()
    ttft = {r.request_id: r.first_token_time - r.arrival_time for r in result.finished}
    assert sorted(r.num_cached_tokens for r in result.finished) == [0, 1024, 1024]
    for request_id in ttft:
        assert abs(result.predicted_ttft_s[request_id] - ttft[request_id]) < 0.05, (request_id, ttft)


def test_with_every_instance_draining_dispatch_answers_as_the_live_scheduler_lets_it(monkeypatch):
    # was: the simulator refused as overloaded (no instance to predict on); the live scheduler's
    # check leaves such a request to dispatch, which falls back to a draining instance
    import msgspec

    config = SimConfig(num_instances=2, admission=AdmissionModel(AdmissionPolicy.PREDICTED, SLO))
    loads = ClusterSimulator.loads
    monkeypatch.setattr(ClusterSimulator, "loads",
                        lambda self: [msgspec.structs.replace(load, draining=True) for load in loads(self)])
    rows = [SimArrival(i, 1.0 * i, 100, 4, 0) for i in range(3)]
    result = ClusterSimulator(config, get_policy("corral"), Workload(rows, "hand-made")).run()
    assert len(result.finished) == 3 and not result.rejected
