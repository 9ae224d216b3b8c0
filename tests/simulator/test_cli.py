"""`loadgen simulate`: options in, table/JSON/plots out, one clear error for bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from loadgen.errors import LoadgenError
from loadgen.simulator import cli
from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.workload import WorkloadSpec, build_workload
from services.llumlet.migration.protocol import MigrationLimits
from shared.policy.baselines import get_policy
from shared.policy.prefix_dispatch import (
    DEFAULT_CACHED_QUEUE_WEIGHT,
    DEFAULT_HELD_REQUEST_TOKENS,
    DEFAULT_SATURATION_WEIGHT,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loadgen")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["simulate", *argv])


def test_a_small_sweep_writes_table_json_and_plots(tmp_path, capsys):
    args = parse(
        "--dataset", "synthetic:M-M", "--num-requests", "60", "--rates", "4,8", "--instances", "3",
        "--policy", "corral,infaas++", "--priority-fraction", "0.2", "--step-mode", "v0",
        "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots"), "--quiet",
    )
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "corral" in out and "infaas++" in out and "  high" in out
    document = json.loads((tmp_path / "r.json").read_text())
    runs = document["runs"]
    assert [(r["policy"], r["rate"]) for r in runs] == [("corral", 4), ("infaas++", 4), ("corral", 8), ("infaas++", 8)]
    assert all(r["completed"] == 60 for r in runs)
    assert document["settings"]["cluster"]["num_instances"] == 3
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert "sweep.png" in plots and "latency_cdf_rate4.png" in plots and "timeline_infaaspp_rate8.png" in plots


def test_autoscale_options_reach_the_simulation(capsys):
    args = parse("--dataset", "random:200:50", "--num-requests", "40", "--rate", "2", "--instances", "2",
                 "--autoscale", "--min-instances", "1", "--max-instances", "3", "--scale-band", "5,30",
                 "--policy", "corral", "--quiet")
    assert cli.run(args) == 0
    config = cli.build_config(args)
    assert config.autoscale.scaling.max_instances == 3 and config.autoscale.scaling.scale_in_above == 30


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "fifo", "--rate", "1"], "unknown policy 'fifo'"),
        (["--rates", "1,x"], "expected numbers separated by commas"),
        (["--rates", "1,-2"], "every rate must be > 0"),
        ([], "give a request rate"),
        (["--rate", "1", "--instances", "0"], "at least one instance"),
        (["--rate", "1", "--gpu", "V100"], "unknown GPU 'V100'"),
        (["--rate", "1", "--priority-fraction", "1.5"], "priority fraction must be within"),
        (["--rate", "1", "--autoscale", "--scale-band", "40"], "expected X,Y"),
        (["--rate", "1", "--autoscale", "--scale-band", "40,2"], "scale-out bound < scale-in bound"),
        (["--rate", "1", "--autoscale", "--min-instances", "20"], "min instances <= max instances"),
        (["--rate", "1", "--migrate-out-freeness", "20"], "must be below --migrate-in-freeness"),
        (["--rate", "1", "--migration-bandwidth-gbps", "0"], "positive number of GB/s"),
        (["--rate", "1", "--trace-timestamps"], "has no timestamps"),
        (["--rate", "1", "--max-num-batched-tokens", "0"], "max_num_batched_tokens must be positive"),
        (["--rate", "1", "--migration-hold-max-ms", "-1"], "hold_max_s must be >= 0"),
        (["--rate", "1", "--migration-hold-max-ms", "50", "--migration-hold-step-share", "1.5"],
         r"step_share must be in \(0, 1\]"),
        (["--rate", "1", "--migration-max-in", "0"], "migrations per instance and hand-off concurrency must be positive"),
        (["--rate", "1", "--migration-notice-steps", "0"], "at least one step ahead"),
    ],
)
def test_bad_input_is_one_clear_error(argv, message):
    args = parse("--dataset", "synthetic:S-S", "--num-requests", "10", "--quiet", *argv)
    with pytest.raises(LoadgenError, match=message):
        cli.run(args)


def test_missing_dataset_file_is_a_clear_error(tmp_path):
    args = parse("--dataset", f"burstgpt:{tmp_path / 'absent.csv'}", "--rate", "1", "--quiet")
    with pytest.raises(LoadgenError, match="no such file"):
        cli.run(args)


def test_the_step_token_budget_is_a_flag_and_cut_prompts_are_counted_in_a_warning(capsys):
    args = parse("--dataset", "random:400:20", "--num-requests", "40", "--rate", "2", "--instances", "2",
                 "--max-model-len", "300", "--max-num-batched-tokens", "128", "--policy", "infaas++", "--quiet")
    config = cli.build_config(args)
    assert config.scheduler.max_num_batched_tokens == 128 and config.scheduler.max_model_len == 300
    assert cli.SimConfig().scheduler.max_num_batched_tokens == 2048  # (the default, from SchedulerConfig)
    workload = build_workload(WorkloadSpec("random:400:20", num_requests=40, rate=2), config.max_seq_len)
    assert workload.num_truncated > 0
    assert cli.run(args) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert f"warning: {workload.num_truncated} of 40 prompts do not fit" in err and "cut to 299 tokens" in err
    args = parse("--dataset", "random:100:20", "--num-requests", "10", "--rate", "2", "--policy", "infaas++", "--quiet")
    assert cli.run(args) == 0 and "warning" not in capsys.readouterr().err


def test_the_step_token_budget_shapes_the_steps():
    def max_prefill_chunk(budget: str) -> int:
        args = parse("--dataset", "random:1500:4", "--num-requests", "6", "--rate", "50", "--instances", "1",
                     "--max-num-batched-tokens", budget, "--policy", "round-robin", "--quiet")
        sim = ClusterSimulator(cli.build_config(args), get_policy("round-robin"),
                               build_workload(WorkloadSpec("random:1500:4", num_requests=6, rate=50), 8191))
        chunks = []
        original = sim.instances["i000"].latency.step_time_of

        def spy(step):
            chunks.extend(tokens for tokens, _ in step.prefill_chunks)
            return original(step)

        sim.instances["i000"].latency = type("Spy", (), {"step_time_of": staticmethod(spy)})()
        sim.run()
        return max(chunks)

    assert max_prefill_chunk("256") == 256 and max_prefill_chunk("4096") > 256


def test_the_room_wait_weight_is_a_flag_inf_included_and_a_bad_one_a_usage_error(tmp_path, capsys):
    args = parse("--dataset", "random:200:20", "--num-requests", "20", "--rate", "2", "--instances", "2",
                 "--prefix-caching", "--policy", "corral-prefix", "--prefix-room-wait-weight", "inf",
                 "--out", str(tmp_path / "r.json"), "--quiet")
    assert cli.build_config(args).prefix_room_wait_weight == float("inf")
    assert cli.run(args) == 0
    document = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert document["settings"]["cluster"]["prefix_room_wait_weight"] == "inf"
    assert cli.build_config(parse("--dataset", "random:200:20", "--rate", "1")).prefix_room_wait_weight == 1.0
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit) as exit_info:
            parse("--dataset", "random:200:20", "--rate", "1", "--prefix-room-wait-weight", bad)
        assert exit_info.value.code == 2
        assert "--prefix-room-wait-weight" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, default, bad_values", [
    ("--prefix-saturation-weight", "0", DEFAULT_SATURATION_WEIGHT, ("-1", "nan", "inf", "x")),
    ("--prefix-cached-queue-weight", "1", DEFAULT_CACHED_QUEUE_WEIGHT, ("-0.1", "1.5", "nan", "x")),
    ("--prefix-held-request-tokens", "64", DEFAULT_HELD_REQUEST_TOKENS, ("-1", "nan", "inf", "x")),
])
def test_a_prefix_weight_is_a_flag_and_a_bad_one_a_usage_error(flag, value, default, bad_values, capsys):
    base = ("--dataset", "random:200:20", "--rate", "1")
    field = flag.removeprefix("--").replace("-", "_")
    assert getattr(cli.build_config(parse(*base, flag, value)), field) == float(value)
    assert getattr(cli.build_config(parse(*base)), field) == default
    for bad in bad_values:
        with pytest.raises(SystemExit) as exit_info:
            parse(*base, flag, bad)
        assert exit_info.value.code == 2
        assert flag in capsys.readouterr().err


def test_the_notice_steps_are_a_flag_as_the_llumlets():
    base = ("--dataset", "synthetic:S-S", "--num-requests", "10", "--rate", "1", "--quiet")
    assert cli.build_config(parse(*base, "--migration-notice-steps", "1")).migration.notice_steps == 1
    assert cli.build_config(parse(*base)).migration.notice_steps == MigrationLimits().notice_steps
