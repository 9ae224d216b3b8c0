"""The llumlet's migration flags reach the limits its migration runtime is built with."""

from __future__ import annotations

import argparse

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
