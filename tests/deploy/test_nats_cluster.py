"""The Kubernetes NATS configuration, run by a real nats-server: it parses (`nats-server -t`), and
three servers started from it (routes pointed at 127.0.0.1 in place of the headless Service's
names) form a full mesh that carries a message published on one server to a subscriber on another."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request

import nats
import pytest
import yaml
from nats.errors import Error as NatsError

from shared import nats_auth
from shared.embedded_nats import nats_server_binary
from tests.deploy.manifests import KUBERNETES, find
from tests.support.cluster import free_port


def nats_conf(tmp_path) -> str:
    """The ConfigMap's nats.conf, its `include` of the corral-credentials Secret's nats-server.conf
    pointed at one made here as the operator would (python -m shared.nats_auth DIR)."""
    docs = [d for d in yaml.safe_load_all((KUBERNETES / "base" / "nats.yaml").read_text()) if d]
    conf = find(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert "include ../auth/nats-server.conf" in conf  # beside the ConfigMap's directory: the Secret's
    nats_auth.write_deployment(tmp_path / "auth")
    return conf.replace("include ../auth/", "include auth/")  # (the test writes its configs in tmp_path)


def test_the_config_parses(tmp_path):
    path = tmp_path / "nats.conf"
    path.write_text(nats_conf(tmp_path).replace("/var/run/nats/", f"{tmp_path}/"))
    done = subprocess.run([nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "POD_NAME": "nats-0"})
    assert done.returncode == 0, done.stderr


async def test_three_servers_from_it_form_a_cluster(tmp_path):
    conf = nats_conf(tmp_path)
    ports = [{"client": free_port(), "cluster": free_port(), "monitor": free_port()} for _ in range(3)]
    processes = []
    try:
        for i, own in enumerate(ports):
            text = conf.replace("port: 4222", f"port: {own['client']}").replace("http_port: 8222", f"http_port: {own['monitor']}")
            text = text.replace("port: 6222", f"port: {own['cluster']}").replace("/var/run/nats/", f"{tmp_path}/{i}-")
            for j, peer in enumerate(ports):
                text = text.replace(f"nats-{j}.nats-headless:6222", f"127.0.0.1:{peer['cluster']}")
            assert "nats-headless" not in text and "4222" not in text
            path = tmp_path / f"nats-{i}.conf"
            path.write_text(text)
            processes.append(subprocess.Popen([nats_server_binary(), "-c", str(path)], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, env={**os.environ, "POD_NAME": f"nats-{i}"}))
        deadline = time.monotonic() + 30
        routes: list[int] = []
        while time.monotonic() < deadline:
            try:
                routes = [_routez(p["monitor"])["num_routes"] for p in ports]
            except OSError:
                routes = []
            if routes and all(n >= 2 for n in routes):
                break
            await asyncio.sleep(0.2)
        assert routes and all(n >= 2 for n in routes), routes
        names = {_varz(p["monitor"])["server_name"] for p in ports}
        assert names == {"nats-0", "nats-1", "nats-2"}  # server_name from $POD_NAME
        with pytest.raises(NatsError, match="Authorization Violation"):  # anonymous: refused
            await nats.connect(f"nats://127.0.0.1:{ports[0]['client']}", allow_reconnect=False,
                               max_reconnect_attempts=0)
        creds = {role: nats_auth.read_credentials(str(tmp_path / "auth" / f"{role}.creds")) for role in nats_auth.ROLES}
        first = await nats.connect(f"nats://127.0.0.1:{ports[0]['client']}", **creds["llumlet"])
        last = await nats.connect(f"nats://127.0.0.1:{ports[2]['client']}", **creds["scheduler"])
        try:
            got = asyncio.get_running_loop().create_future()

            async def on_message(msg) -> None:
                if not got.done():
                    got.set_result(msg.data)

            await last.subscribe("corral.load.test", cb=on_message)
            await last.flush()
            deadline = time.monotonic() + 10
            while not got.done() and time.monotonic() < deadline:  # interest reaches the other server
                await first.publish("corral.load.test", b"across the route")
                await asyncio.sleep(0.1)
            assert await asyncio.wait_for(got, 1) == b"across the route"
        finally:
            await first.close()
            await last.close()
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)


def _routez(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/routez", timeout=2) as reply:
        return json.load(reply)


def _varz(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=2) as reply:
        return json.load(reply)
