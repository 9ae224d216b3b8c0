"""Gateway configuration: flags over env vars over defaults, and clear errors for bad settings."""

from __future__ import annotations

import argparse
import json

import pytest

from services.gateway.config import ConfigError, GatewayConfig, add_arguments, config_from_args
from services.gateway.tokenizer import ModelTokenizer


def parse(argv: list[str], env: dict[str, str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv), env or {})


def test_flags_win_over_env_and_env_over_defaults():
    config = parse(["--model", "/m/llama", "--port", "9000"],
                   {"CORRAL_GATEWAY_PORT": "7000", "CORRAL_DISPATCH_TIMEOUT_S": "0.25", "CORRAL_MODEL_DIR": "/x"})
    assert (config.model_dir, config.port, config.dispatch_timeout_s) == ("/m/llama", 9000, 0.25)
    assert config.instance_timeout_s == 3.0 and config.default_max_tokens is None


def test_served_model_name_defaults_to_the_directory_name():
    assert parse(["--model", "/models/tiny-llama/"]).model_name == "tiny-llama"
    assert parse(["--model", "/m/x", "--served-model-name", "corral-7b"]).model_name == "corral-7b"


def test_default_gateway_id_is_a_valid_subject_token_and_unique():
    first, second = parse(["--model", "/m"]), parse(["--model", "/m"])
    assert first.gateway_id.startswith("gw-") and first.gateway_id != second.gateway_id


@pytest.mark.parametrize("argv, env, complaint", [
    ([], {}, "no model directory"),
    (["--model", "/m", "--gateway-id", "gw.1"], {}, "gateway id"),
    (["--model", "/m", "--port", "70000"], {}, "port"),
    (["--model", "/m", "--dispatch-timeout-s", "0"], {}, "dispatch_timeout_s"),
    (["--model", "/m"], {"CORRAL_GATEWAY_PORT": "eighty"}, "CORRAL_GATEWAY_PORT"),
])
def test_bad_settings_are_config_errors(argv, env, complaint):
    with pytest.raises(ConfigError, match=complaint):
        parse(argv, env)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelTokenizer.load(str(tmp_path / "nowhere"))


def test_model_without_a_context_length_needs_max_model_len(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="--max-model-len"):
        ModelTokenizer.load(str(tmp_path))


def test_directory_without_a_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        ModelTokenizer.load(str(tmp_path))


def test_prompt_tokens_details_is_vllms_switch_off_by_default():
    assert not parse(["--model", "/m"]).enable_prompt_tokens_details
    assert parse(["--model", "/m", "--enable-prompt-tokens-details"]).enable_prompt_tokens_details
    assert parse(["--model", "/m"], {"CORRAL_ENABLE_PROMPT_TOKENS_DETAILS": "true"}).enable_prompt_tokens_details
