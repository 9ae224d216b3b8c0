"""The llumlet's migration flags reach the limits its migration runtime is built with."""

from __future__ import annotations

import argparse

import pytest

from services.llumlet.config import add_arguments, migration_limits_from_args
from services.llumlet.migration.protocol import MigrationLimits


def limits(*argv: str) -> MigrationLimits:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return migration_limits_from_args(parser.parse_args(list(argv)))


def test_token_frames_are_on_by_default_and_can_be_turned_off(monkeypatch) -> None:
    assert limits().token_frames
    assert not limits("--no-migration-token-frames").token_frames
    assert limits("--migration-token-frames").token_frames
    monkeypatch.setenv("CORRAL_MIGRATION_TOKEN_FRAMES", "0")
    assert not limits().token_frames


def test_the_notice_steps_are_a_flag_and_an_env_setting_and_zero_is_refused(monkeypatch) -> None:
    assert limits().notice_steps == 1
    assert limits("--migration-notice-steps", "3").notice_steps == 3
    monkeypatch.setenv("CORRAL_MIGRATION_NOTICE_STEPS", "5")
    assert limits().notice_steps == 5
    with pytest.raises(SystemExit, match="notice_steps must be >= 1"):
        limits("--migration-notice-steps", "0")
