"""Prefill/decode disaggregation with the real vLLM engine (issue 19 §2): two vLLM llumlets, one
`--role prefill` and one `--role decode`. Every request is dispatched to the prefill instance,
streams its first token from there, is handed to the decode instance by live migration, and its
greedy output is exactly `vllm.LLM.generate`'s; both instances get every block back."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.cluster import Cluster
from tests.support.stream_watch import StreamWatch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # (minutes of real vLLM: CI's `slow` run)

PREFILL, DECODE = "vllm-prefill", "vllm-decode"
LLUMLET = ("--max-model-len", "512", "--vllm-kv-cache-gib", "0.02", "--report-interval-s", "0.05")
OUTPUT_LEN = 200


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    from shared.embedded_nats import start_nats

    server = start_nats()
    cluster = Cluster(server.url, tiny_model_dir, tmp_path_factory.mktemp("vllm-pd-logs"))
    cluster.start_scheduler()
    cluster.start_llumlet(PREFILL, *LLUMLET, "--role", "prefill", engine="vllm")
    cluster.start_llumlet(DECODE, *LLUMLET, "--role", "decode", engine="vllm")
    cluster.start_gateway()
    try:
        cluster.wait_ready(instances=2, timeout_s=240)
        yield cluster
    finally:
        cluster.stop()
        server.stop()


def all_free(latest) -> bool:
    return all(
        i in latest and latest[i].num_blocks_free == latest[i].num_blocks_total and latest[i].reserved_blocks == 0
        and latest[i].num_running == 0 and latest[i].num_waiting == 0 and latest[i].num_migrating == 0
        for i in (PREFILL, DECODE)
    )


async def test_greedy_output_across_the_handoff_matches_vllm_generate(cluster, tiny_model_dir):
    from tests.vllm.helpers import small_engine_config_for, start_reference_run

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer.encode(text) for text in ("The quick brown fox", "Corral hands requests off", "你好，世界")]
    sampling = {"temperature": 0.0, "max_tokens": OUTPUT_LEN, "ignore_eos": True}
    reference = start_reference_run(small_engine_config_for(tiny_model_dir), prompts, sampling)
    try:
        async with StreamWatch(cluster.nats_url) as watch, \
                httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
            assert await watch.wait_for(all_free, 30), watch.latest
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            replies = await asyncio.gather(*(
                http.post("/v1/completions", json={"model": model, "prompt": ids, **sampling}) for ids in prompts
            ))
            expected = await asyncio.to_thread(reference.result)
            for reply, ids in zip(replies, expected):
                assert reply.status_code == 200, reply.text
                body = reply.json()
                assert body["usage"]["completion_tokens"] == len(ids) == OUTPUT_LEN
                assert body["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)
                request_id = body["id"]
                assert await watch.wait_finished(request_id)
                assert watch.tokens(request_id) == list(ids)  # no gap, no duplicate: vLLM's own tokens
                # Dispatched to the prefill instance, which streamed the first token; then decoded there.
                assert watch.publishers(request_id) == [PREFILL, DECODE], request_id
                first = next(c for c in watch.chunks[request_id] if c.start_index == 0 and c.token_ids)
                assert first.instance_id == PREFILL
            assert await watch.wait_for(all_free, 10), watch.latest
    finally:
        reference.close()
