"""Shared fixtures: one real nats-server per test run, the tiny model, real Corral processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.embedded_nats import start_nats

# Every service process a test starts logs here (and inherits these settings).
os.environ.setdefault("CORRAL_LOG_LEVEL", "INFO")


@pytest.fixture(scope="session")
def nats_server():
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from services.tools.make_model import make_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_tiny_model(path, seed=0)
    return path
