"""`corral up --metrics-port P`: every process serves its own /metrics, a real Prometheus stores the
vllm:* series under their names, and start-up says what it does (or who died, and why)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster import REPO, free_port

INSTANCES = 2


def free_port_run(count: int) -> int:
    """A port P with P .. P+count-1 all free now."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free ports")


def wait_for_line(log: Path, needle: str, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if needle in text:
            return text
        if process.poll() is not None:
            raise AssertionError(f"corral up exited ({process.returncode}):\n{text}")
        time.sleep(0.3)
    raise AssertionError(f"no {needle!r} in {timeout_s} s:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def corral_up(tiny_model_dir, tmp_path_factory):
    """`corral up` with 2 simulated llumlets and metrics on; (gateway port, metrics port, output)."""
    log = tmp_path_factory.mktemp("corral-up") / "up.log"
    port, metrics_port = free_port(), free_port_run(1 + INSTANCES)
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--engine", "sim", "--instances",
                               str(INSTANCES), "--port", str(port), "--metrics-port", str(metrics_port), "--model",
                               str(tiny_model_dir), "--sim-time-scale", "0.1"],
                              cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        output = wait_for_line(log, "corral up: ready", up, 120)
        yield port, metrics_port, output
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


def samples(url: str) -> list:
    text = httpx.get(url, timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_every_process_serves_its_own_metrics_and_up_says_where(corral_up):
    port, metrics_port, output = corral_up
    for line in ("corral up: embedded NATS up at", "corral up: started scheduler", "corral up: started llumlet-1",
                 "corral up: gateway connected to NATS", f"corral up: instances reporting: {INSTANCES}/{INSTANCES}",
                 f"corral up: metrics of scheduler: http://127.0.0.1:{metrics_port}/metrics",
                 f"corral up: metrics of llumlet-1: http://127.0.0.1:{metrics_port + 2}/metrics"):
        assert line in output, output
    assert output.index(f"reporting: {INSTANCES}/{INSTANCES}") < output.index("corral up: ready")
    for i in range(INSTANCES):
        running = [s for s in samples(f"http://127.0.0.1:{metrics_port + 1 + i}/metrics")
                   if s.name == "vllm:num_requests_running"]
        assert [s.labels["engine"] for s in running] == [f"llumlet-{i}"]
    assert any(s.name == "corral:scheduler_live_instances" and s.value == INSTANCES
               for s in samples(f"http://127.0.0.1:{metrics_port}/metrics"))

    model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": model, "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    engine = [s for s in samples(f"http://127.0.0.1:{port}/metrics")
              if s.name == "vllm:request_success_total" and s.value == 1]
    assert [s.labels["finished_reason"] for s in engine] == ["length"]
    served_by = engine[0].labels["engine"]
    gateway = {s.name: s.value for s in samples(f"http://127.0.0.1:{port}/metrics")
               if s.labels.get("engine") == served_by}
    assert gateway["vllm:time_to_first_token_seconds_count"] == 1
    assert gateway["vllm:inter_token_latency_seconds_count"] >= 1  # 3 gaps, fewer if chunks carried several tokens
    llumlet_port = metrics_port + 1 + int(served_by.removeprefix("llumlet-"))
    llumlet = {s.name: s.value for s in samples(f"http://127.0.0.1:{llumlet_port}/metrics")}
    assert llumlet["vllm:generation_tokens_total"] == 4
    assert llumlet["vllm:request_queue_time_seconds_count"] == 1
    assert llumlet["vllm:request_prefill_time_seconds_count"] == 1
    assert 0 < llumlet["vllm:request_prefill_time_seconds_sum"] < gateway["vllm:time_to_first_token_seconds_sum"]
    # Tokens per step (no prefix cache: every prompt token computed, in the step of the first token),
    # the request's inference time and preemptions, and once per client request its n and longest output.
    assert llumlet["vllm:iteration_tokens_total_sum"] == llumlet["vllm:prompt_tokens_total"] + 4
    assert llumlet["vllm:iteration_tokens_total_count"] >= 4
    assert llumlet["vllm:request_inference_time_seconds_count"] == 1
    assert llumlet["vllm:request_inference_time_seconds_sum"] >= llumlet["vllm:request_prefill_time_seconds_sum"]
    assert llumlet["vllm:request_num_preemptions_count"] == 1
    assert gateway["vllm:request_params_n_sum"] == gateway["vllm:request_params_n_count"] == 1
    assert gateway["vllm:request_max_num_generation_tokens_sum"] == 4
    assert gateway["vllm:request_prefill_kv_computed_tokens_sum"] == gateway["vllm:request_prompt_tokens_sum"] > 0

    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": model, "prompt": "hello", "max_tokens": 3, "n": 2, "ignore_eos": True})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2, reply.text

    def gateway_total(name: str) -> float:
        return sum(s.value for s in samples(f"http://127.0.0.1:{port}/metrics") if s.name == name)

    assert (gateway_total("vllm:request_params_n_count"), gateway_total("vllm:request_params_n_sum")) == (2, 3)
    assert gateway_total("vllm:request_max_num_generation_tokens_sum") == 4 + 3
    assert gateway_total("vllm:request_params_max_tokens_count") == 3  # per choice, as vLLM's child requests


def prometheus_query(url: str, query: str) -> list[dict]:
    reply = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5).json()
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus is not installed (scripts/install_prometheus.sh installs it)")
def test_a_real_prometheus_stores_the_vllm_names(corral_up, tmp_path):
    port, metrics_port, _ = corral_up
    targets = [f"127.0.0.1:{p}" for p in (port, *range(metrics_port, metrics_port + 1 + INSTANCES))]
    config = tmp_path / "prometheus.yml"  # JSON is YAML
    config.write_text('{"global": {"scrape_interval": "1s"}, "scrape_configs": [{"job_name": "corral", '
                      f'"static_configs": [{{"targets": {targets!r}}}]}}]}}'.replace("'", '"'))
    listen = free_port()
    with open(tmp_path / "prometheus.log", "wb") as out:
        prometheus = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path}/data",
                                       f"--web.listen-address=127.0.0.1:{listen}"],
                                      stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen}"
    try:
        deadline = time.monotonic() + 60
        found: list[dict] = []
        reasons: set[str] = set()
        # Each target is scraped on its own schedule: wait for the llumlets' series and the gateway's.
        while time.monotonic() < deadline and (len(found) < INSTANCES or not {"stop", "length", "abort", "error"} <= reasons):
            time.sleep(1)
            try:
                found = prometheus_query(url, "vllm:num_requests_running")
                reasons = {r["metric"]["finished_reason"] for r in prometheus_query(url, "vllm:request_success_total")}
            except httpx.HTTPError:
                continue
        log = (tmp_path / "prometheus.log").read_text(errors="replace")
        assert sorted(r["metric"]["engine"] for r in found) == [f"llumlet-{i}" for i in range(INSTANCES)], log
        assert {"stop", "length", "abort", "error"} <= reasons
        for series in ("vllm:iteration_tokens_total_bucket", "vllm:request_params_n_count",
                       "vllm:request_inference_time_seconds_count", "vllm:num_requests_waiting_by_reason"):
            assert prometheus_query(url, series), series
        assert prometheus_query(url, '{__name__=~"vllm_.+|corral_.+"}') == []  # nothing stored with underscores
    finally:
        prometheus.terminate()
        prometheus.wait(30)


def test_a_child_that_dies_while_starting_is_named_with_its_last_lines(tiny_model_dir, tmp_path):
    """Unknown flags go to every llumlet: this one makes llumlet-0 exit at once."""
    up = subprocess.run([sys.executable, "-m", "services.cli", "up", "--engine", "sim", "--instances", "1", "--port",
                         str(free_port()), "--model", str(tiny_model_dir), "--no-such-flag"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert up.returncode == 1
    said = up.stdout + up.stderr
    assert "llumlet-0 exited with code 2; its last lines:" in said, said
    assert "unrecognized arguments: --no-such-flag" in said.split("its last lines:")[1], said
    assert "corral up: ready" not in said


def test_ctrl_c_in_a_terminal_stops_everything_in_order(tiny_model_dir, tmp_path):
    """A terminal's Ctrl-C signals the whole foreground process group: NATS must not go first,
    from under services that are still draining."""
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--engine", "sim", "--instances", "1",
                               "--port", str(free_port()), "--model", str(tiny_model_dir)],
                              cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_line(log, "corral up: ready", up, 120)
        os.killpg(up.pid, signal.SIGINT)  # what the terminal does
        assert up.wait(60) == 0
        said = log.read_text(errors="replace")
        assert "Traceback" not in said and "NATS error" not in said, said  # no server gone from under them
    finally:
        if up.poll() is None:
            up.kill()
