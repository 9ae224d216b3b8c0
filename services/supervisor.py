"""`corral up`: an embedded NATS server and every service as a child process, stopped together.

It says what it is doing while things start (each child, NATS, the gateway, instances reporting),
"ready" only once the gateway can serve, and when a child dies it names it and shows its last
log lines (each child's output goes through us: forwarded as it comes, the tail kept).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from services.cpu_layout import CpuLayout, format_cpus
from services.process_helpers import child_setup
from shared.embedded_nats import EmbeddedNats, start_nats
from services.llumlet.migration import kv_auth
from shared.nats_auth import EmbeddedAuth

log = logging.getLogger("corral.up")

TAIL_LINES = 20  # of a dead child's output, shown when it dies
# A child that dies is started again after this long, doubled (up to the cap) each time it dies
# again within STABLE_S of its start: a crash loop backs off instead of spinning.
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 60.0
STABLE_S = 60.0


def own_session(setup: Callable[[], None]) -> Callable[[], None]:
    """`setup`, in a session of its own: a terminal's Ctrl-C signals the whole foreground group,
    and NATS must outlive the services that drain through it (`Cluster.stop` ends it last)."""

    def run() -> None:
        os.setsid()
        setup()

    return run


def say(message: str) -> None:
    """Progress for the person who ran `corral up` (stdout; the children's logs go to stderr)."""
    print(f"corral up: {message}", flush=True)


@dataclass
class Child:
    name: str
    argv: list[str]
    cpus: frozenset[int] | None = None  # the cores it may run on (None: any)
    metrics_url: str | None = None  # where its Prometheus /metrics is, when on
    process: subprocess.Popen | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    _forwarder: threading.Thread | None = None
    started_at: float = 0.0  # time.monotonic() of the last start

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *self.argv], preexec_fn=child_setup(self.cpus),
            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # a pipe would hold its prints back, out of order
        )
        self._forwarder = threading.Thread(target=self._forward, name=f"output:{self.name}", daemon=True)
        self._forwarder.start()
        where = "" if self.cpus is None else f" on cores {format_cpus(self.cpus)}"
        say(f"started {self.name} (pid {self.process.pid}){where}")

    def _forward(self) -> None:
        """Its output to our stderr as it comes, the last lines kept for when it dies."""
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            self.tail.append(raw.decode(errors="replace").rstrip("\n"))
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def death_notice(self) -> str:
        """Who died, how, and what it said last."""
        assert self.process is not None
        if self._forwarder is not None:
            self._forwarder.join(timeout=2)  # the last lines may still be in the pipe
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return f"{self.name} exited with code {self.process.returncode}; its last lines:\n{lines}"


@dataclass
class Cluster:
    children: list[Child] = field(default_factory=list)
    nats: EmbeddedNats | None = None

    def dead(self) -> list[Child]:
        return [child for child in self.children if not child.alive()]

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


@dataclass(frozen=True)
class GatewayState:
    """What the gateway says about itself (`answering` False: nothing else is known)."""

    answering: bool
    connected: bool = False
    instances: int = 0


def reachable_url(host: str, port: int) -> str:
    """Where this machine reaches a server bound to `host` (a wildcard: through loopback)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "[::1]" if host == "::" else host
    return f"http://{host}:{port}"


def gateway_state(url: str) -> GatewayState:
    """From the gateway's readiness endpoint: 200 or 503, its body says whether it is connected to
    NATS and how many instances are live."""
    try:
        body = httpx.get(f"{url}/ready", timeout=1.0).json()
        return GatewayState(answering=True, connected=bool(body["connected"]), instances=int(body["instances"]))
    except (httpx.HTTPError, ValueError, TypeError, KeyError, AttributeError):
        return GatewayState(answering=False)


def wait_ready(url: str, instances: int, timeout_s: float, cluster: Cluster,
               stop_requested: Callable[[], bool] = lambda: False,
               probe: Callable[[str], GatewayState] = gateway_state) -> str | None:
    """Until the gateway is connected and sees every instance: None, or why it is not ready
    (a child died, the time ran out, a stop was asked for). Says each step on the way."""
    deadline = time.monotonic() + timeout_s
    last: GatewayState | None = None
    while time.monotonic() < deadline:
        if stop_requested():
            return "stopped while starting"
        dead = cluster.dead()
        if dead:
            return f"{dead[0].death_notice()}"
        state = probe(url)
        if state != last:
            was = last or GatewayState(answering=False)
            if state.answering and not was.answering:
                say(f"gateway answering on {url}")
            if state.connected and not was.connected:
                say("gateway connected to NATS")
            if state.connected and (not was.connected or state.instances != was.instances):
                say(f"instances reporting: {state.instances}/{instances}")
            last = state
        if state.connected and state.instances >= instances:
            return None
        time.sleep(0.2)
    seen = "the gateway never answered" if last is None or not last.answering else (
        "the gateway is not connected to NATS" if not last.connected else
        f"{last.instances}/{instances} instances reporting")
    return f"not ready after {timeout_s:.0f} s: {seen}"


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
    host: str = "127.0.0.1",
    cpu_layout: CpuLayout | None = None,
    metrics_port: int = 0,
    roles: Sequence[str] = (),
) -> int:
    """`cpu_layout`: each llumlet on its own cores, everything else on the control plane's.
    `metrics_port` P > 0: the scheduler serves /metrics on P, llumlet i on P + 1 + i (each its
    own: one port for all would leave all but one dead); the gateway on its HTTP port."""
    cluster = Cluster()
    control = cpu_layout.control if cpu_layout is not None else None
    url = reachable_url(host, port)
    stop_requested = False

    def on_signal(signum, frame) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    auth: EmbeddedAuth | None = None
    # The llumlets' KV data plane: peers prove this secret (kv_auth); in the environment, not argv.
    os.environ.setdefault(kv_auth.ENV_SECRET, kv_auth.new_secret())
    try:
        if nats_url is None:  # with a user per role, each allowed only its own subjects
            auth = EmbeddedAuth.create()
            cluster.nats = start_nats(preexec_fn=own_session(child_setup(control)), config=auth.config)
            nats_url = cluster.nats.url
            say(f"embedded NATS up at {nats_url} (credentials per role in {auth.directory}; "
                f"tools: --nats-creds {auth.paths['admin']})")
        else:
            say(f"using NATS at {nats_url}")
        cluster.children = plan_children(nats_url, instances, gateway_args, llumlet_args, scheduler_args,
                                         autoscaler_args, cpu_layout, url, metrics_port, roles)
        for child in cluster.children if auth is not None else ():
            child.argv = auth.argv_for(child.argv)
        for child in reversed(cluster.children):  # scheduler first, gateway last
            child.start()
        count = "initial " if autoscaler_args is not None else ""
        say(f"waiting for the gateway and {instances} {count}instance(s) to report")
        why_not = wait_ready(url, instances, ready_timeout_s, cluster, lambda: stop_requested)
        if why_not is not None:
            if not stop_requested:
                log.error("Corral did not start: %s", why_not)
                return 1
            return 0
        for child in cluster.children:
            if child.metrics_url is not None:
                say(f"metrics of {child.name}: {child.metrics_url}")
        say(f"ready: {url}/v1  ({instances} llumlets, NATS {nats_url})")
        watch(cluster, lambda: stop_requested)
        return 0
    finally:
        log.info("stopping Corral")
        cluster.stop()
        if auth is not None:
            auth.remove()


def plan_children(nats_url: str, instances: int, gateway_args: list[str], llumlet_args: list[str],
                  scheduler_args: list[str], autoscaler_args: list[str] | None, cpu_layout: CpuLayout | None,
                  gateway_url: str, metrics_port: int, roles: Sequence[str] = ()) -> list[Child]:
    """Gateway first, scheduler last (the order they stop in); every metrics port distinct.
    `roles`: llumlet i's `--role` (after the user's flags: `--prefill/--decode` win)."""
    control = cpu_layout.control if cpu_layout is not None else None
    common = ["--nats-url", nats_url]

    def metrics(offset: int) -> tuple[list[str], str | None]:
        """The flag (always given, so a CORRAL_METRICS_PORT in the environment cannot make them collide)."""
        if metrics_port <= 0:
            return ["--metrics-port", "0"], None
        return ["--metrics-port", str(metrics_port + offset)], f"http://127.0.0.1:{metrics_port + offset}/metrics"

    children = [Child("gateway", ["gateway", *common, *gateway_args], control, metrics_url=f"{gateway_url}/metrics")]
    if autoscaler_args is None:
        for i in range(instances):
            cpus = cpu_layout.engines[i] if cpu_layout is not None else None
            # As many torch threads as cores of its own (before llumlet_args: a user's flag wins).
            threads = [] if cpus is None else ["--vllm-cpu-threads", str(len(cpus))]
            flag, url = metrics(1 + i)
            role = ["--role", roles[i]] if i < len(roles) else []
            argv = ["llumlet", *common, "--instance-id", f"llumlet-{i}", *threads, *flag, *llumlet_args, *role]
            children.append(Child(f"llumlet-{i}", argv, cpus, metrics_url=url))
    else:
        children.append(Child("autoscaler", ["autoscaler", *common, *autoscaler_args], control))
    flag, url = metrics(0)
    children.append(Child("scheduler", ["scheduler", *common, *flag, *scheduler_args], control, metrics_url=url))
    return children


def watch(cluster: Cluster, stop_requested: Callable[[], bool]) -> None:
    """Until asked to stop: a child that dies is named, with its last lines, and started again
    (a llumlet, say, that a fault killed: the rest keeps running meanwhile)."""
    waits: dict[str, float] = {}  # the next restart's delay, per child
    due: dict[str, float] = {}  # when a dead child starts again
    while not stop_requested():
        now = time.monotonic()
        for child in cluster.dead():
            if child.name not in due:
                stable = now - child.started_at > STABLE_S
                wait = RESTART_FIRST_S if stable else waits.get(child.name, RESTART_FIRST_S)
                waits[child.name] = min(RESTART_MAX_S, wait * 2)
                due[child.name] = now + wait
                log.error("%s; restarting it in %.0f s", child.death_notice(), wait)
            elif now >= due[child.name]:
                del due[child.name]
                child.start()
        time.sleep(0.2)
