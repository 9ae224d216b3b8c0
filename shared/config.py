"""Configuration helpers: every setting is a CLI flag whose default comes from an env variable.

Each service keeps one typed dataclass of its own settings (units in the field names); these
helpers only spare each of them the env-parsing boilerplate.
"""

from __future__ import annotations

import argparse
import math
import os
import uuid

from shared import nats_auth

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def env(name: str, default):
    """`CORRAL_<NAME>` from the environment, cast to the type of `default` (None: str)."""
    raw = os.environ.get(f"CORRAL_{name}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    if default is None:
        return raw
    try:
        return type(default)(raw)
    except ValueError as exc:
        raise SystemExit(f"CORRAL_{name}={raw!r}: expected a {type(default).__name__}") from exc


def add_nats_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url", default=env("NATS_URL", DEFAULT_NATS_URL), help="NATS server URL (env CORRAL_NATS_URL)"
    )
    nats_auth.add_arguments(parser)


def short_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def non_negative_number(text: str) -> float:
    """argparse type of a finite number >= 0: a clear message, not a traceback."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of a whole number >= 0: a clear message, not a traceback."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return value


def share_of_one(text: str) -> float:
    """argparse type of a number from 0 to 1: a clear message, not a traceback."""
    value = non_negative_number(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def non_negative_or_inf(text: str) -> float:
    """argparse type of a number >= 0 or `inf`: a clear message, not a traceback."""
    if text.strip().lower() == "inf":
        return math.inf
    try:
        return non_negative_number(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 or inf, got {text!r}") from None
