"""Real Corral processes for end-to-end tests: scheduler, llumlets and a gateway on one NATS."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.process_helpers import die_with_parent

REPO = Path(__file__).resolve().parents[2]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port nothing listens on now, below the kernel's ephemeral range where there is room.
    A port from `bind(0)` is an ephemeral one: once we close it the kernel may hand it to the next
    `bind(0)` or outgoing connection of any process before the service we start binds it (a CI
    run lost a gateway so, to something starting beside it). Below that range only an explicit
    bind takes a port. Chosen by the system's randomness, so seeded tests do not all pick alike."""
    low, _ = _ephemeral_range()
    if low > 11024:
        pick = random.SystemRandom()
        for _ in range(100):
            port = pick.randint(low - 10000, low - 1)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
            self.process.wait()

    def terminate(self, timeout_s: float = 20.0) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Cluster:
    nats_url: str
    model_dir: Path
    log_dir: Path
    gateway_port: int = 0
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every process
    repo: Path = REPO  # the tree whose services run (benchmarks compare another revision's)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def spawn(self, name: str, *argv: str, env: dict[str, str] | None = None) -> ServiceProcess:
        log_path = self.log_dir / f"{name}.log"
        handle = open(log_path, "ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv, "--nats-url", self.nats_url],
            cwd=self.repo,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env, **(env or {})},
            preexec_fn=die_with_parent,  # a test killed at its timeout leaves no service behind
        )
        handle.close()
        proc = ServiceProcess(name, process, log_path)
        self.procs[name] = proc
        return proc

    def start_scheduler(self, *extra: str) -> ServiceProcess:
        return self.spawn("scheduler", "scheduler", *extra)

    def start_llumlet(self, instance_id: str, *extra: str, engine: str = "sim") -> ServiceProcess:
        return self.spawn(
            instance_id,
            "llumlet",
            "--instance-id",
            instance_id,
            "--engine",
            engine,
            "--model",
            str(self.model_dir),
            *extra,
        )

    def start_autoscaler(self, *extra: str, llumlet_args: tuple[str, ...] = ()) -> ServiceProcess:
        import shlex

        args = shlex.join(["--engine", "sim", "--model", str(self.model_dir), *llumlet_args])
        return self.spawn("autoscaler", "autoscaler", "--llumlet-args", args, *extra)

    def start_gateway(self, *extra: str) -> ServiceProcess:
        self.gateway_port = free_port()
        return self.spawn("gateway", "gateway", "--model", str(self.model_dir), "--port", str(self.gateway_port), *extra)

    def wait_ready(self, instances: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited early:\n{proc.log()[-3000:]}")
            try:
                reply = httpx.get(f"{self.base_url}/healthz", timeout=1.0)
                if reply.status_code == 200 and reply.json().get("instances", 0) >= instances:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.log()[-2000:]}" for p in self.procs.values())
        raise TimeoutError(f"cluster not ready after {timeout_s} s\n{logs}")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()


@contextlib.contextmanager
def running_cluster(model_dir: Path, log_dir: Path, instances: Sequence[str], *llumlet_args: str, engine: str = "sim",
                    scheduler_args: Sequence[str] = (), gateway_args: Sequence[str] = (),
                    timeout_s: float = 120.0) -> Iterator[Cluster]:
    """A nats-server, a scheduler, these llumlets and a gateway, ready; all stopped on exit
    (also when they never became ready)."""
    from shared.embedded_nats import start_nats

    server = start_nats()
    cluster = Cluster(server.url, model_dir, log_dir)
    try:
        cluster.start_scheduler(*scheduler_args)
        for instance_id in instances:
            cluster.start_llumlet(instance_id, *llumlet_args, engine=engine)
        cluster.start_gateway(*gateway_args)
        cluster.wait_ready(instances=len(instances), timeout_s=timeout_s)
        yield cluster
    finally:
        cluster.stop()
        server.stop()
