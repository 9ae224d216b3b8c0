"""`corral up`: an embedded NATS server and every service as a child process, stopped together."""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from shared.embedded_nats import EmbeddedNats, start_nats

log = logging.getLogger("corral.up")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *self.argv], preexec_fn=die_with_parent, start_new_session=True
        )
        log.info("started %s (pid %d)", self.name, self.process.pid)

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
) -> int:
    cluster = Cluster()
    stop_requested = False

    def on_signal(signum, frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if nats_url is None:
            cluster.nats = start_nats()
            nats_url = cluster.nats.url
            log.info("embedded NATS at %s", nats_url)
        common = ["--nats-url", nats_url]
        cluster.children.append(Child("gateway", ["gateway", *common, *gateway_args]))
        if autoscaler_args is None:
            cluster.children.extend(
                Child(f"llumlet-{i}", ["llumlet", *common, "--instance-id", f"llumlet-{i}", *llumlet_args])
                for i in range(instances)
            )
        else:
            cluster.children.append(Child("autoscaler", ["autoscaler", *common, *autoscaler_args]))
        cluster.children.append(Child("scheduler", ["scheduler", *common, *scheduler_args]))
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
