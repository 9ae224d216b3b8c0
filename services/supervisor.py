"""`corral up`: an embedded NATS server and every service as a child process, stopped together."""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from services.cpu_layout import CpuLayout, format_cpus, keep_to
from shared.embedded_nats import EmbeddedNats, start_nats

log = logging.getLogger("corral.up")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    """Between fork and exec: die with the parent, and keep to `cpus` (None: wherever)."""

    keep = keep_to(cpus)

    def setup() -> None:
        die_with_parent()
        if keep is not None:
            keep()

    return setup


@dataclass
class Child:
    name: str
    argv: list[str]
    cpus: frozenset[int] | None = None  # the cores it may run on (None: any)
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *self.argv], preexec_fn=child_setup(self.cpus),
            start_new_session=True,
        )
        where = "" if self.cpus is None else f" on cores {format_cpus(self.cpus)}"
        log.info("started %s (pid %d)%s", self.name, self.process.pid, where)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Cluster:
    children: list[Child] = field(default_factory=list)
    nats: EmbeddedNats | None = None

    def stop(self, grace_s: float = 15.0) -> None:
        """Gateway first (no new work), then llumlets, then the scheduler, then NATS."""
        for child in self.children:
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", child.name, grace_s)
                child.process.kill()
                child.process.wait()
        if self.nats is not None:
            self.nats.stop()


def wait_ready(port: int, instances: int, timeout_s: float, cluster: Cluster) -> bool:
    """Ready when the gateway answers /healthz and sees every llumlet's reports."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not all(child.alive() for child in cluster.children):
            return False
        try:
            reply = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0)
            if reply.status_code == 200 and reply.json().get("instances", 0) >= instances:
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    return False


def run_cluster(
    *,
    nats_url: str | None,
    instances: int,
    gateway_args: list[str],
    llumlet_args: list[str],
    scheduler_args: list[str],
    autoscaler_args: list[str] | None,
    port: int,
    ready_timeout_s: float,
    cpu_layout: CpuLayout | None = None,
) -> int:
    """`cpu_layout`: each llumlet on its own cores, everything else on the control plane's."""
    cluster = Cluster()
    control = cpu_layout.control if cpu_layout is not None else None
    stop_requested = False

    def on_signal(signum, frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if nats_url is None:
            cluster.nats = start_nats(preexec_fn=keep_to(control))
            nats_url = cluster.nats.url
            log.info("embedded NATS at %s", nats_url)
        common = ["--nats-url", nats_url]
        cluster.children.append(Child("gateway", ["gateway", *common, *gateway_args], control))
        if autoscaler_args is None:
            for i in range(instances):
                cpus = cpu_layout.engines[i] if cpu_layout is not None else None
                # As many torch threads as cores of its own (before llumlet_args: a user's flag wins).
                threads = [] if cpus is None else ["--vllm-cpu-threads", str(len(cpus))]
                argv = ["llumlet", *common, "--instance-id", f"llumlet-{i}", *threads, *llumlet_args]
                cluster.children.append(Child(f"llumlet-{i}", argv, cpus))
        else:
            cluster.children.append(Child("autoscaler", ["autoscaler", *common, *autoscaler_args], control))
        cluster.children.append(Child("scheduler", ["scheduler", *common, *scheduler_args], control))
        for child in reversed(cluster.children):  # scheduler first, gateway last
            child.start()
        if not wait_ready(port, instances, ready_timeout_s, cluster):
            if not stop_requested:
                log.error("Corral did not become ready in %.0f s", ready_timeout_s)
                return 1
        else:
            print(f"Corral is up: http://127.0.0.1:{port}/v1  ({instances} llumlets, NATS {nats_url})", flush=True)
        reported_dead: set[str] = set()
        while not stop_requested:
            for child in cluster.children:
                if not child.alive() and child.name not in reported_dead:
                    reported_dead.add(child.name)
                    log.error("%s exited with code %s; the rest keeps running", child.name, child.process.returncode)
            time.sleep(0.2)
        return 0
    finally:
        log.info("stopping Corral")
        cluster.stop()
