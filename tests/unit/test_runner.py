"""A service stops on SIGTERM even while it is still starting (here: waiting for a NATS server
that is not there), instead of retrying forever."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.support.cluster import REPO, free_port


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:  # the process ended (its stderr closed) before saying it
            break
        seen += line
        if needle in line:
            return seen
    raise AssertionError(f"no {needle!r} within {timeout_s} s (exit code {proc.poll()}):\n{seen}")


@pytest.mark.parametrize("command", [
    ["llumlet", "--engine", "sim", "--instance-id", "starting"],
    ["scheduler"],
])
def test_sigterm_while_waiting_for_nats_stops_the_service(command):
    url = f"nats://127.0.0.1:{free_port()}"  # free, so nothing listens: connects are refused
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *command, "--nats-url", url], cwd=REPO,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        _wait_for_line(proc, "Connection refused", timeout_s=60)  # it is retrying the connect
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        proc.wait()
