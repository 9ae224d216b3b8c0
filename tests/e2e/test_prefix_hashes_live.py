"""Gateway → scheduler with prompt block hashes: the gateway hashes the prompt at the block size
the llumlets report and the scheduler takes the dispatch request; the llumlets cache prefixes.
(Dispatch by those hashes: tests/e2e/test_prefix_dispatch_live.py.)"""

from __future__ import annotations

import httpx
import nats
import pytest

from shared import subjects
from shared.messages import DispatchRequest, decode
from shared.nats_client import flush_in_order
from shared.prefix_hash import block_hashes
from tests.support.cluster import running_cluster

SIM_ARGS = ("--sim-time-scale", "0.1", "--sim-num-blocks", "400", "--max-model-len", "2048", "--sim-prefix-caching")


@pytest.fixture(scope="module")
def prefix_cluster(tiny_model_dir, tmp_path_factory):
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("prefix-logs"), ["pc-0", "pc-1"], *SIM_ARGS,
                         "--sim-block-size", "16", gateway_args=["--dispatch-prefix-hashes", "true"]) as cluster:
        yield cluster


async def test_dispatch_requests_carry_the_prompts_chain(prefix_cluster):
    nc = await nats.connect(prefix_cluster.nats_url)
    seen: list[DispatchRequest] = []

    async def on_dispatch(msg) -> None:
        seen.append(decode(msg.data, DispatchRequest))

    await nc.subscribe(subjects.DISPATCH, cb=on_dispatch)
    try:
        async with httpx.AsyncClient(base_url=prefix_cluster.base_url, timeout=60) as http:
            name = (await http.get("/v1/models")).json()["data"][0]["id"]
            prompt = [7] * 40 + list(range(100, 140))  # 80 token ids: 5 full blocks of 16
            for _ in range(2):
                reply = await http.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 4})
                assert reply.status_code == 200, reply.text
        await flush_in_order(nc)
    finally:
        await nc.close()
    assert len(seen) == 2
    for request in seen:
        assert request.prefix_block_size == 16 and request.block_hashes == block_hashes(prompt, 16)
