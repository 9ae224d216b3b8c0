"""A service stops on SIGTERM even while it is still starting (here: waiting for a NATS server
that is not there), instead of retrying forever."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen += line
        if needle in line:
            return seen
    raise AssertionError(f"no {needle!r} within {timeout_s} s:\n{seen}")


@pytest.mark.parametrize("command", [
    ["llumlet", "--engine", "sim", "--instance-id", "starting"],
    ["scheduler"],
])
def test_sigterm_while_waiting_for_nats_stops_the_service(command):
    url = f"nats://127.0.0.1:{_closed_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *command, "--nats-url", url], cwd=REPO_ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        _wait_for_line(proc, "Connection refused", timeout_s=60)  # it is retrying the connect
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        proc.wait()
