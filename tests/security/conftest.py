"""A real cluster for the security tests: scheduler, two simulated llumlets and a gateway on a
nats-server of their own (attacks must not leak into other modules), each with a metrics port."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from tests.support.cluster import Cluster, free_port

SIM_ARGS = ("--sim-time-scale", "1", "--sim-num-blocks", "851", "--max-model-len", "2048")
GATEWAY_ID = "sec-gw"
INSTANCES = ("sec-0", "sec-1")


@dataclass
class SecurityCluster:
    cluster: Cluster
    metrics_ports: dict[str, int]  # service name -> its /metrics port (the gateway: its HTTP port)

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    def metric(self, service: str, name: str, **labels: str) -> float:
        """One sample's value from a service's /metrics (0 when absent)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[service]}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and line.split(" ")[0] != name:
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def assert_all_alive(self) -> None:
        for proc in self.cluster.procs.values():
            assert proc.alive(), f"{proc.name} died:\n{proc.log()[-3000:]}"

    def chat(self, max_tokens: int = 8, timeout_s: float = 60) -> httpx.Response:
        return httpx.post(f"{self.base_url}/v1/chat/completions", timeout=timeout_s, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens})


@pytest.fixture(scope="package")
def sec_cluster(tiny_model_dir, tmp_path_factory):
    from shared.embedded_nats import start_nats

    nats = start_nats()
    cluster = Cluster(nats.url, tiny_model_dir, tmp_path_factory.mktemp("security-logs"))
    ports = {"scheduler": free_port(), **{i: free_port() for i in INSTANCES}}
    cluster.start_scheduler("--metrics-port", str(ports["scheduler"]))
    for instance_id in INSTANCES:
        cluster.start_llumlet(instance_id, *SIM_ARGS, "--metrics-port", str(ports[instance_id]))
    cluster.start_gateway("--gateway-id", GATEWAY_ID)
    try:
        cluster.wait_ready(instances=len(INSTANCES))
        ports["gateway"] = cluster.gateway_port
        yield SecurityCluster(cluster, ports)
    finally:
        cluster.stop()
        nats.stop()
