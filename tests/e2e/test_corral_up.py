"""`corral up` starts everything with one command, lays it out on the cores, and Ctrl-C stops every
process it started."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from services.cpu_layout import available_cpus, plan_cpu_layout

from shared.embedded_nats import start_nats
from tests.support.cluster import REPO, Cluster, free_port


def start_up(args: list[str], instances: int, tmp_path, timeout_s: float = 120) -> subprocess.Popen:
    """`corral up ARGS`, once the gateway sees every llumlet (its output in tmp_path/up.log)."""
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--instances", str(instances), *args],
                              cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    port = int(args[args.index("--port") + 1])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json().get("instances") == instances:
                return up
        except (httpx.HTTPError, ValueError):
            pass
        if up.poll() is not None:
            break
        time.sleep(0.3)
    up.kill()
    raise AssertionError((tmp_path / "up.log").read_text())


def chat_once(port: int) -> None:
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert reply.status_code == 200, reply.text


def stop_up(up: subprocess.Popen, tmp_path) -> None:
    """Ctrl-C, and every process it started is gone."""
    family = psutil.Process(up.pid).children(recursive=True)
    up.send_signal(signal.SIGINT)
    assert up.wait(60) == 0, (tmp_path / "up.log").read_text()
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def test_corral_up_serves_and_stops_cleanly(tiny_model_dir, tmp_path):
    port = free_port()
    up = start_up(["--engine", "sim", "--port", str(port), "--model", str(tiny_model_dir), "--sim-time-scale", "0.1"],
                  2, tmp_path)
    try:
        chat_once(port)
        family = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in family)
        assert names.count("services.cli llumlet") == 2 and "nats-server" in names and "gateway" in names
        # The simulated engine computes nothing: no process is bound to cores.
        everywhere = set(os.sched_getaffinity(0))
        assert all(set(p.cpu_affinity()) == everywhere for p in family)
        stop_up(up, tmp_path)
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.skipif(plan_cpu_layout(available_cpus(), 1) is None, reason="one core: nothing to lay out")
def test_corral_up_gives_a_vllm_llumlet_cores_of_its_own(tiny_model_dir, tmp_path):
    port = free_port()
    up = start_up(["--engine", "vllm", "--port", str(port), "--model", str(tiny_model_dir),
                   "--vllm-kv-cache-gib", "0.05"], 1, tmp_path, timeout_s=240)
    try:
        chat_once(port)
        layout = plan_cpu_layout(available_cpus(), 1)
        family = psutil.Process(up.pid).children(recursive=True)
        roles = {p.pid: " ".join(p.cmdline()) for p in family}
        llumlet = next(p for p in family if "services.cli llumlet" in roles[p.pid])
        assert set(llumlet.cpu_affinity()) == layout.engines[0]
        assert f"--vllm-cpu-threads {len(layout.engines[0])}" in roles[llumlet.pid]
        # Every thread vLLM started inherited the llumlet's cores.
        assert all(set(os.sched_getaffinity(t.id)) == layout.engines[0] for t in llumlet.threads())
        for role in ("services.cli gateway", "services.cli scheduler", "nats-server"):
            proc = next(p for p in family if role in roles[p.pid])
            assert set(proc.cpu_affinity()) == layout.control, role
        stop_up(up, tmp_path)
    finally:
        if up.poll() is None:
            up.kill()


def test_no_live_instance_is_a_503(tiny_model_dir, tmp_path):
    nats = start_nats()
    cluster = Cluster(nats.url, tiny_model_dir, tmp_path)
    cluster.start_gateway()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{cluster.base_url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, cluster.procs["gateway"].log()
            time.sleep(0.2)
        model = httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=30,
                           json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503
        assert reply.json()["error"]["message"]
    finally:
        cluster.stop()
        nats.stop()
