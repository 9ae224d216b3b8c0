"""The llumlet's command line reaches the simulated engine's settings."""

from __future__ import annotations

import argparse

import pytest

from services.llumlet.config import add_arguments, config_from_args
from services.llumlet.engines import create_engine


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--engine", "sim", *argv])


def test_sim_admission_and_priority_preemption_default_to_vllms_behaviour():
    sim = config_from_args(parse()).sim.scheduler
    assert sim.reserve_full_sequence and sim.preempt_for_priority


def test_sim_admission_and_priority_preemption_can_be_turned_off(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "eos_token_id": 2}')
    config = config_from_args(parse("--no-sim-reserve-full-sequence", "--no-sim-preempt-for-priority",
                                    "--model", str(tmp_path)))
    assert not config.sim.scheduler.reserve_full_sequence and not config.sim.scheduler.preempt_for_priority
    engine_config = create_engine(config).config.scheduler
    assert not engine_config.reserve_full_sequence and not engine_config.preempt_for_priority


def test_sim_flags_read_the_environment(monkeypatch):
    monkeypatch.setenv("CORRAL_SIM_RESERVE_FULL_SEQUENCE", "0")
    assert config_from_args(parse()).sim.scheduler.reserve_full_sequence is False


def test_a_bad_sim_flag_is_a_usage_error():
    with pytest.raises(SystemExit):
        parse("--sim-reserve-full-sequence=maybe")


def test_out_of_range_engine_settings_end_the_llumlet_with_the_reason():
    with pytest.raises(SystemExit, match="bad sim engine settings: num_blocks must be positive"):
        create_engine(config_from_args(parse("--sim-num-blocks", "0")))


def test_vllm_cpu_threads_reach_the_engine_settings(monkeypatch, tmp_path):
    assert config_from_args(parse()).vllm.cpu_threads == 1
    assert config_from_args(parse("--vllm-cpu-threads", "4")).vllm.cpu_threads == 4
    monkeypatch.setenv("CORRAL_VLLM_CPU_THREADS", "3")
    assert config_from_args(parse()).vllm.cpu_threads == 3


def test_vllm_cpu_threads_below_one_is_refused():
    from services.llumlet.engines.vllm.engine import VllmEngineConfig  # (does not import vLLM)

    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        VllmEngineConfig(model_dir="unused", cpu_threads=0)
