"""A 3-node NATS cluster (three nats-server processes with routes): every service is given all
three URLs; killing the node some of them are connected to, under load, fails no request."""

from __future__ import annotations

import asyncio

import httpx

from shared.embedded_nats import start_nats
from tests.chaos.harness import GenerateLog, dead_processes, judge, model_name, stream_completion, wait_blocks_back
from tests.chaos.test_instance_death import expected, prompts
from tests.support.cluster import free_port

STREAMS = 24
TOKENS = 300


def start_nats_cluster(tmp_path, size: int = 3) -> list:
    route_ports = [free_port() for _ in range(size)]
    routes = ", ".join(f"nats://127.0.0.1:{p}" for p in route_ports)
    servers = []
    for i, port in enumerate(route_ports):
        config = tmp_path / f"nats-{i}.conf"
        config.write_text(f"server_name: n{i}\ncluster {{\n  name: corral\n  listen: 127.0.0.1:{port}\n"
                          f"  routes: [{routes}]\n}}\n")
        servers.append(start_nats(config=config))
    return servers


async def test_one_of_three_nats_nodes_killed_under_load(make_cluster, tiny_model_dir, tmp_path):
    servers = start_nats_cluster(tmp_path)
    try:
        urls = ",".join(server.url for server in servers)
        await asyncio.sleep(1.0)  # routes form
        cluster = make_cluster(3, nats_url=urls)
        name = model_name(cluster)
        async with GenerateLog(servers[0].url) as orders, \
                httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            await asyncio.sleep(0.5)  # our interest reaches the other nodes
            streams = [asyncio.create_task(stream_completion(http, name, p, TOKENS)) for p in prompts(STREAMS)]
            await asyncio.sleep(1.5)  # mid-decode
            servers[1].process.kill()
            outcomes = await asyncio.gather(*streams)
            after = await asyncio.gather(*(stream_completion(http, name, [p + 3 for p in prompt], 20)
                                           for prompt in prompts(8)))
        tally = judge(outcomes, expected(tiny_model_dir, orders, prompts(STREAMS), TOKENS))
        after_tally = judge(after)
        print(f"\nNATS node killed: in flight {tally.line()} resumed {len(orders.resumes)}; after: "
              f"{after_tally.line()}")
        assert tally.completed == STREAMS and tally.wrong == 0, (tally, [o.error for o in outcomes if o.error][:3])
        assert after_tally.completed == 8, after_tally
        assert not (left := await wait_blocks_back(servers[0].url, ["sim-0", "sim-1", "sim-2"])), left
        assert dead_processes(cluster) == []
    finally:
        for server in servers:
            server.stop()
