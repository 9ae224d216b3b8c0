"""The systems the overhead benchmarks compare, each started fresh on this machine: Corral (gateway,
scheduler and one vLLM llumlet on an embedded NATS server, laid out on the cores as `corral up`
does, or unplaced) and vLLM's own OpenAI server. Shared by vllm_overhead.py and client_agreement.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from services.cpu_layout import available_cpus, cpu_layout_decision
from services.process_helpers import child_setup


REPO = Path(__file__).resolve().parents[1]


GIB = 1 << 30


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_env() -> dict[str, str]:
    """Our environment less VLLM_CPU_KVCACHE_SPACE: on CPU it would override the byte-exact size."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def spawn(name: str, argv: Sequence[str], log_dir: Path, extra_env: dict[str, str] | None = None,
          cpus: frozenset[int] | None = None) -> Proc:
    """`cpus`: the cores the process may run on (None: any)."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(list(argv), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 env={**engine_env(), **(extra_env or {})}, start_new_session=True,
                                 preexec_fn=child_setup(cpus))
    return Proc(name, popen, log_path)


@dataclass
class Settings:
    model_dir: Path
    model_name: str
    max_model_len: int
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    llumlet_env: dict[str, str] = field(default_factory=dict)  # experiments: e.g. OMP_NUM_THREADS=1


class System:
    """One serving system under test: started fresh, probed until ready, stopped."""

    name: str

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def ready(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout_s: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            for proc in self.procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited early:\n{proc.tail()}")
            try:
                if self.ready():
                    return time.monotonic() - started
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        logs = "\n".join(f"--- {p.name}\n{p.tail(1500)}" for p in self.procs)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:g} s\n{logs}")

    def processes(self) -> dict[str, psutil.Process]:
        """Every process of the system (children included), by a readable role name."""
        out: dict[str, psutil.Process] = {}
        for proc in self.procs:
            try:
                root = psutil.Process(proc.popen.pid)
                out[proc.name] = root
                for i, child in enumerate(root.children(recursive=True)):
                    out[f"{proc.name}/child{i}:{child.name()}"] = child
            except psutil.NoSuchProcess:
                pass
        return out


class CorralSystem(System):
    """Laid out on the cores as `corral up` would (`services/cpu_layout.py`): the llumlet on cores
    of its own, NATS, scheduler and gateway on the rest; vLLM's server binds its worker likewise."""

    name = "corral"
    cpu_layout_mode = "auto"

    def start(self) -> None:
        from shared.embedded_nats import nats_server_binary

        s = self.settings
        decision = cpu_layout_decision(self.cpu_layout_mode, "vllm", 1, False, available_cpus())
        (self.log_dir / "cpu_layout.txt").write_text(decision.reason + "\n")
        layout = decision.layout
        control, engine_cpus = (layout.control, layout.engines[0]) if layout is not None else (None, None)
        threads = [] if engine_cpus is None else ["--vllm-cpu-threads", str(len(engine_cpus))]
        nats_port = free_port()
        self.procs.append(spawn("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(nats_port)], self.log_dir,
                                cpus=control))
        nats_url = f"nats://127.0.0.1:{nats_port}"
        self.port = free_port()
        cli = [sys.executable, "-m", "services.cli"]
        self.procs.append(spawn("scheduler", [*cli, "scheduler", "--nats-url", nats_url], self.log_dir, cpus=control))
        self.procs.append(spawn("llumlet", [
            *cli, "llumlet", "--nats-url", nats_url, "--instance-id", "bench-0", "--engine", "vllm",
            "--model", str(s.model_dir), "--max-model-len", str(s.max_model_len),
            "--vllm-kv-cache-gib", repr(s.kv_cache_bytes / GIB), "--vllm-max-num-seqs", str(s.max_num_seqs), *threads,
        ], self.log_dir, s.llumlet_env, cpus=engine_cpus))
        self.procs.append(spawn("gateway", [
            *cli, "gateway", "--nats-url", nats_url, "--model", str(s.model_dir), "--port", str(self.port),
            "--max-model-len", str(s.max_model_len), "--log-level", "warning",
        ], self.log_dir, cpus=control))

    def ready(self) -> bool:
        reply = httpx.get(f"{self.base_url}/healthz", timeout=1.0)
        return reply.status_code == 200 and reply.json().get("instances", 0) >= 1


class UnplacedCorralSystem(CorralSystem):
    """Every process free to run on any core (`corral up --cpu-layout off`)."""

    name = "corral-unplaced"
    cpu_layout_mode = "off"


class VllmSystem(System):
    name = "vllm"

    def start(self) -> None:
        s = self.settings
        self.port = free_port()
        self.procs.append(spawn("api_server", [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model_dir),
            "--served-model-name", s.model_name, "--dtype", "float32", "--max-model-len", str(s.max_model_len),
            "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port),
            "--kv-cache-memory-bytes", str(s.kv_cache_bytes), "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--seed", "0",
            "--disable-log-stats", "--uvicorn-log-level", "warning",
        ], self.log_dir))

    def ready(self) -> bool:
        return httpx.get(f"{self.base_url}/v1/models", timeout=1.0).status_code == 200


def make_system(name: str, settings: Settings, log_dir: Path) -> System:
    return SYSTEMS[name](settings, log_dir)


SYSTEMS = {system.name: system for system in (CorralSystem, UnplacedCorralSystem, VllmSystem)}
