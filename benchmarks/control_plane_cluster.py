"""The control-plane benchmark's cluster and load generators: a real nats-server, scheduler(s) and
gateway as processes; the impersonated fleet (benchmarks/fleet_impersonator.py) in processes of
their own; an open-loop dispatcher and closed-loop streaming clients, each in a child process so
that their CPU is not the control plane's; CPU and NATS counters over a measured window."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import multiprocessing as mp
import psutil

from benchmarks.fleet_impersonator import (
    BATCHING,
    BUSY_S,
    CHUNKS,
    MESSAGES,
    NUM_COUNTERS,
    REPORTS,
    run_impersonator,
)
from services.process_helpers import die_with_parent
from shared import subjects
from shared.embedded_nats import nats_server_binary
from shared.messages import DispatchReply, DispatchRequest, decode, encode
from shared.nats_client import request as nats_request


ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def _wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up in {timeout_s:g} s")


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def _dispatch_open_loop(nats_url: str, rate: float, seconds: float) -> tuple[list[float], float, int]:
    """Sends at `rate`/s on a fixed schedule (late sends go at once: open loop); round trips in s."""
    import nats

    nc = await nats.connect(nats_url, name="bench-dispatch")
    latencies: list[float] = []
    failures = 0

    async def one(i: int) -> None:
        nonlocal failures
        request = DispatchRequest(request_id=f"bench-{uuid.uuid4().hex}", num_prompt_tokens=64 + (i * 37) % 2000,
                                  max_tokens=128)
        started = time.perf_counter()
        try:
            reply = decode((await nats_request(nc, subjects.DISPATCH, encode(request), 2.0)).data, DispatchReply)
        except Exception:  # noqa: BLE001 - timeouts counted
            failures += 1
            return
        latencies.append(time.perf_counter() - started)
        if reply.instance_id is None:
            failures += 1

    tasks = []
    begin = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    sent_over = time.perf_counter() - begin
    await asyncio.gather(*tasks)
    await nc.close()
    return latencies, len(tasks) / sent_over, failures


async def _stream_closed_loop(base_url: str, model: str, concurrency: int, seconds: float,
                              max_tokens: int) -> tuple[int, int, int]:
    """`concurrency` clients streaming completions back to back; (requests, tokens, failures)."""
    import httpx

    done = tokens = failures = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        async def worker() -> None:
            nonlocal done, tokens, failures
            while time.perf_counter() < deadline:
                body = {"model": model, "prompt": "hello world", "max_tokens": max_tokens, "stream": True,
                        "ignore_eos": True}
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            failures += 1
                            await response.aread()
                            continue
                        async for line in response.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                tokens += 1
                    done += 1
                except Exception:  # noqa: BLE001 - counted
                    failures += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, tokens, failures


def _client_main(kind: str, args: tuple, out) -> None:
    import uvloop

    coroutine = _dispatch_open_loop(*args) if kind == "dispatch" else _stream_closed_loop(*args)
    out.put(uvloop.run(coroutine))


def in_child(kind: str, args: tuple) -> tuple[object, float]:
    """Runs a client in a process of its own; (its result, its CPU seconds)."""
    queue = mp.Queue()
    child = mp.Process(target=_client_main, args=(kind, args, queue))
    child.start()
    proc = psutil.Process(child.pid)
    cpu = 0.0
    result = None
    while result is None:
        try:
            cpu = _cpu_s(proc)
        except psutil.Error:
            pass
        try:
            result = queue.get(timeout=0.2)
        except Exception:  # noqa: BLE001 - queue.Empty: keep polling the CPU
            if not child.is_alive():
                raise RuntimeError(f"{kind} client died") from None
    child.join()
    return result, cpu


class Cluster:
    def __init__(self, model_dir: str, log_dir: Path, scheduler_args: list[str], scheduler_root: Path,
                 scheduler_replicas: int = 1) -> None:
        self.monitor_port = _free_port()
        nats_port = _free_port()
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.procs["nats"] = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(nats_port), "-m", str(self.monitor_port)],
            stdout=subprocess.DEVNULL, stderr=open(log_dir / "nats.log", "wb"), preexec_fn=die_with_parent)
        _wait_for(lambda: self.varz(), 10, "nats-server")
        python = sys.executable
        for k in range(scheduler_replicas):  # replicas share the dispatch subject as a queue group
            self.procs["scheduler" if k == 0 else f"scheduler-{k + 1}"] = subprocess.Popen(
                [python, "-m", "services.cli", "scheduler", "--nats-url", self.nats_url, *scheduler_args],
                cwd=scheduler_root, stdout=subprocess.DEVNULL, stderr=open(log_dir / f"scheduler-{k}.log", "wb"),
                preexec_fn=die_with_parent)
        self.http_port = _free_port()
        self.procs["gateway"] = subprocess.Popen(
            [python, "-m", "services.cli", "gateway", "--model", model_dir, "--nats-url", self.nats_url,
             "--port", str(self.http_port), "--log-level", "warning"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log_dir / "gateway.log", "wb"), preexec_fn=die_with_parent)
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        _wait_for(lambda: _get_json(self.base_url + "/v1/models"), 60, "gateway")
        _wait_for(lambda: self.connection("global-scheduler"), 30, "scheduler")
        self.model = _get_json(self.base_url + "/v1/models")["data"][0]["id"]
        self.ps = {name: psutil.Process(p.pid) for name, p in self.procs.items()}

    def varz(self) -> dict:
        return _get_json(f"http://127.0.0.1:{self.monitor_port}/varz")

    def connection(self, name: str) -> dict | None:
        for conn in _get_json(f"http://127.0.0.1:{self.monitor_port}/connz?limit=1024")["connections"]:
            if conn.get("name") == name:
                return conn
        return None

    def cpu(self) -> dict[str, float]:
        """Per process; `scheduler` sums the replicas."""
        cpu = {name: _cpu_s(p) for name, p in self.ps.items() if not name.startswith("scheduler")}
        cpu["scheduler"] = sum(_cpu_s(p) for name, p in self.ps.items() if name.startswith("scheduler"))
        return cpu

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "nats"] + ["nats"]:
            proc = self.procs[name]
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Fleet:
    """N impersonated llumlets over `processes` processes."""

    def __init__(self, nats_url: str, n: int, processes: int, step_s: float, heartbeat_s: float = 0.0,
                 drift_share: float = 1.0) -> None:
        ids = [f"fake-{i:05d}" for i in range(n)]
        self.stop_event = mp.Event()
        self.counters = [mp.Array("d", NUM_COUNTERS, lock=False) for _ in range(processes)]
        self.children = [mp.Process(target=run_impersonator,
                                    args=(nats_url, ids[k::processes], 0.05, step_s, self.counters[k],
                                          self.stop_event, k, heartbeat_s, drift_share), daemon=True)
                         for k in range(processes)]
        for child in self.children:
            child.start()
        self.ps = [psutil.Process(c.pid) for c in self.children]

    def set_batching(self, on: bool) -> None:
        for counters in self.counters:
            counters[BATCHING] = 1.0 if on else 0.0

    def total(self, slot: int) -> float:
        return sum(c[slot] for c in self.counters)

    def cpu(self) -> float:
        return sum(_cpu_s(p) for p in self.ps)

    def stop(self) -> None:
        self.stop_event.set()
        for child in self.children:
            child.join(5)
            if child.is_alive():
                child.kill()


class Window:
    """Counters over one measurement phase."""

    def __init__(self, cluster: Cluster, fleet: Fleet) -> None:
        self.cluster, self.fleet = cluster, fleet
        self.t = time.perf_counter()
        self.cpu = cluster.cpu()
        self.fleet_cpu = fleet.cpu()
        self.fleet_busy = fleet.total(BUSY_S)
        self.reports = fleet.total(REPORTS)
        self.chunks = fleet.total(CHUNKS)
        self.chunk_messages = fleet.total(MESSAGES)
        varz = cluster.varz()
        self.in_msgs, self.out_msgs = varz["in_msgs"], varz["out_msgs"]
        self.sched_out = cluster.connection("global-scheduler")["out_msgs"]

    def close(self) -> dict:
        now = Window(self.cluster, self.fleet)
        elapsed = now.t - self.t
        return {
            "seconds": elapsed,
            "cpu_per_s": {name: (now.cpu[name] - self.cpu[name]) / elapsed for name in self.cpu},
            "impersonators_cpu_per_s": (now.fleet_cpu - self.fleet_cpu) / elapsed,
            "impersonators_busy_per_s": (now.fleet_busy - self.fleet_busy) / elapsed,
            "reports_published": now.reports - self.reports,
            "chunks_published": now.chunks - self.chunks,
            "chunk_messages_published": now.chunk_messages - self.chunk_messages,
            "nats_in": now.in_msgs - self.in_msgs,
            "nats_out": now.out_msgs - self.out_msgs,
            "scheduler_delivered": now.sched_out - self.sched_out,
        }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
