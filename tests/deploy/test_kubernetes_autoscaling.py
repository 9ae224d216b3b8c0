"""The autoscaler's Kubernetes path end to end, short of a cluster: `corral autoscaler --provider
kubernetes` against the stand-in API server, whose ReplicaSet controller runs each pod as a real
llumlet process named after the pod, and deletes a pod as a kubelet does: the preStop
(`corral drain`, as deploy/kubernetes runs it) and then SIGTERM. A load step scales out; idle,
it scales back in, and the pods deleted are exactly the ones the autoscaler drained."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import nats
import pytest

pytest.importorskip("kubernetes")

from shared import subjects  # noqa: E402
from shared.embedded_nats import start_nats  # noqa: E402
from shared.messages import ScalingAction, ScalingEvent, decode  # noqa: E402
from tests.deploy.kube_api_standin import KubeApiStandIn, Kubelet  # noqa: E402
from tests.support.cluster import REPO, Cluster, free_port  # noqa: E402

SIM = ("--sim-num-blocks", "120", "--sim-time-scale", "0.2", "--max-model-len", "1024")


class LocalKubelet:
    """Pods as llumlet processes on this machine."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.metrics_ports: dict[str, int] = {}
        self.exit_codes: dict[str, int] = {}
        self.pre_stop: dict[str, subprocess.CompletedProcess] = {}

    def start(self, pod: str) -> None:
        port = self.metrics_ports[pod] = free_port()
        self.cluster.start_llumlet(pod, *SIM, "--metrics-port", str(port))

    def stop(self, pod: str) -> None:
        self.pre_stop[pod] = subprocess.run(
            [sys.executable, "-m", "services.cli", "drain", "--nats-url", self.cluster.nats_url,
             "--instance-id", pod, "--timeout-s", "60"], cwd=REPO, capture_output=True, text=True, timeout=90)
        self.exit_codes[pod] = self.cluster.procs[pod].terminate()

    def ready(self, pod: str) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.metrics_ports[pod]}/ready", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False


async def test_scale_out_then_in_through_the_deployment_deletes_the_drained_pods(tiny_model_dir, tmp_path):
    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path)
    kubelet = LocalKubelet(cluster)
    events: list[ScalingEvent] = []
    nc = await nats.connect(server.url)

    async def on_event(msg) -> None:
        events.append(decode(msg.data, ScalingEvent))

    await nc.subscribe(subjects.SCALING_EVENTS, cb=on_event)
    api = KubeApiStandIn(replicas=1, kubelet=Kubelet(kubelet.start, kubelet.stop, kubelet.ready))
    try:
        with api:
            cluster.start_scheduler()
            cluster.spawn("autoscaler", "autoscaler", "--provider", "kubernetes", "--k8s-namespace", api.namespace,
                          "--k8s-deployment", api.deployment, "--k8s-api-url", api.url,
                          "--initial-instances", "1", "--min-instances", "1", "--max-instances", "3",
                          "--scale-out-below", "3", "--scale-in-above", "60", "--sustain-s", "0.5",
                          "--cooldown-s", "1.5", "--tick-s", "0.2")
            cluster.start_gateway()
            await asyncio.to_thread(cluster.wait_ready, 1)
            first_pod = next(iter(api.pods))
            model = httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:

                async def one(i: int) -> httpx.Response:
                    await asyncio.sleep(i * 0.05)
                    return await http.post("/v1/completions",
                                           json={"model": model, "prompt": "load " * 100, "max_tokens": 200})

                replies = await asyncio.gather(*(one(i) for i in range(60)))
            assert [r.status_code for r in replies] == [200] * 60, [r.text for r in replies if r.status_code != 200][:3]
            assert all(r.json()["usage"]["completion_tokens"] == 200 for r in replies)
            scaled_out = [e.instance_id for e in events if e.action == ScalingAction.SCALE_OUT]
            assert scaled_out, events
            assert api.replica_history[: 1 + len(scaled_out)] == list(range(1, 2 + len(scaled_out)))
            # The instance ids the autoscaler started are the pods the controller created.
            assert set(scaled_out) <= set(api.pods)
            def settled() -> bool:  # back to one replica, every drain stopped, every deleted pod gone
                drains = sum(e.action == ScalingAction.DRAIN for e in events)
                stops = sum(e.action == ScalingAction.STOPPED for e in events)
                return api.replicas == 1 and drains == stops and len(kubelet.exit_codes) == len(api.deleted)

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not settled():
                await asyncio.sleep(0.2)
            await asyncio.sleep(3 * 0.2 + 1.5)  # a few more ticks past the cooldown: nothing more happens
            drained = [e.instance_id for e in events if e.action == ScalingAction.DRAIN]
            stopped = [e.instance_id for e in events if e.action == ScalingAction.STOPPED]
            story = ([(e.action.value, e.instance_id, e.instances) for e in events], api.deleted, api.replica_history)
            assert api.replicas == 1, story
            assert api.deleted == stopped and sorted(stopped) == sorted(drained), story
            for pod in api.deleted:
                assert kubelet.pre_stop[pod].returncode == 0, kubelet.pre_stop[pod].stderr[-1000:]
                assert "is empty" in kubelet.pre_stop[pod].stderr  # drained before: nothing left to move
                assert kubelet.exit_codes[pod] == 0
            survivors = [p.name for p in api.live_pods()]
            assert len(survivors) == 1 and cluster.procs[survivors[0]].alive()
            assert first_pod in api.pods
    finally:
        await nc.close()
        cluster.stop()
        server.stop()
