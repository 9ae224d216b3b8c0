"""`corral up` starts everything with one command and Ctrl-C stops every process it started."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil

from shared.embedded_nats import start_nats
from tests.support.cluster import REPO, Cluster, free_port


def test_corral_up_serves_and_stops_cleanly(tiny_model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--engine", "sim", "--instances", "2", "--port", str(port),
         "--model", str(tiny_model_dir), "--sim-time-scale", "0.1"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json()
                if health.get("instances") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            time.sleep(0.3)
        else:
            raise AssertionError((tmp_path / "up.log").read_text())
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                           json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        family = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in family)
        assert names.count("services.cli llumlet") == 2 and "nats-server" in names and "gateway" in names
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, (tmp_path / "up.log").read_text()
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if up.poll() is None:
            up.kill()
        log.close()


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
