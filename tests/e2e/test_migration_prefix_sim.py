"""Migration that knows the cache (issue 18 §4), end to end: real scheduler, llumlet and gateway
processes over real NATS, sim engines with prefix caching. The destination already holds the
shared prefix of the requests that move to it: only the blocks after it cross the wire, and
every stream is exactly the request's synthetic token stream (what an unmigrated run sends)."""

from __future__ import annotations

import asyncio
import re

import httpx

from services.llumlet.engines import model_vocabulary
from services.llumlet.engines.sim.engine import SyntheticTokens
from shared.messages import DrainOrder
from tests.e2e.test_migration_sim import (  # noqa: F401 (cluster, llumlets: fixtures)
    SIM,
    Watch,
    all_free,
    cluster,
    llumlets,
    model_name,
    stream_chat,
    wait_ready,
)

SHARED = "You are a careful assistant who answers in full sentences and checks every fact twice. " * 8
KV_BYTES_PER_TOKEN = 256
BLOCK_SIZE = 16  # the sim engine's default
MIGRATED = re.compile(r"migrated (\S+) to (\S+) in \d+ stages .*; KV: (\d+) of (\d+) blocks sent \((\d+) bytes for "
                      r"(\d+) tokens\), (\d+) cached there")


async def test_only_the_blocks_the_destination_lacks_cross_and_streams_stay_exact(cluster, llumlets, tiny_model_dir):
    args = ("--sim-num-blocks", "300", "--sim-kv-bytes-per-token", str(KV_BYTES_PER_TOKEN), "--sim-prefix-caching")
    loaded, warm = llumlets(*args), llumlets(*args)
    vocab, eos, _ = model_vocabulary(str(tiny_model_dir))
    tokens = SyntheticTokens(vocab, eos, seed=0)
    async with Watch(cluster.nats_url) as watch:
        await wait_ready(cluster, watch, loaded, warm)
        model = model_name(cluster)
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
            # The destination-to-be caches the shared prefix: it is the only instance open.
            await watch.order(loaded, DrainOrder(drain=True))
            assert await watch.wait_for(lambda latest: latest[loaded].draining, 5)
            first = await stream_chat(http, model, f"{SHARED} warm-up", 4)
            assert first["error"] is None and watch.publishers(first["id"]) == [warm]
            # Then every request lands on the other one, and moves to it when it opens again.
            await watch.order(loaded, DrainOrder(drain=False))
            await watch.order(warm, DrainOrder(drain=True))
            assert await watch.wait_for(lambda latest: latest[warm].draining and not latest[loaded].draining, 5)
            requests = [asyncio.create_task(stream_chat(http, model, f"{SHARED} question {i}", 900)) for i in range(8)]
            assert await watch.wait_for(lambda latest: latest[loaded].num_running == 8, 10)
            await watch.order(warm, DrainOrder(drain=False))
            results = await asyncio.gather(*requests)
        assert await watch.wait_finished(*(r["id"] for r in results))
        for result in results:
            assert result["error"] is None and result["finish"] == "length"
            key = tokens.key(result["id"])
            assert watch.tokens(result["id"]) == [tokens.token(key, i) for i in range(900)]
        migrated = {r["id"] for r in results if len(watch.publishers(r["id"])) > 1}
        assert migrated, "no request migrated"
        assert await watch.wait_for(lambda latest: all_free(latest, loaded, warm), 10), watch.latest
    moves = [m.groups() for m in MIGRATED.finditer(cluster.procs[loaded].log())]
    assert {request_id for request_id, *_ in moves} == migrated
    prompt_blocks = min(r["usage"]["prompt_tokens"] for r in results) // BLOCK_SIZE
    for request_id, dst, sent, lease, num_bytes, num_tokens, cached in moves:
        sent, lease, num_bytes, num_tokens, cached = int(sent), int(lease), int(num_bytes), int(num_tokens), int(cached)
        assert dst == warm and sent + cached == lease
        # The shared prefix was there: every prompt block up to the one its question starts in.
        assert cached >= prompt_blocks - 2, (cached, prompt_blocks)
        # Each computed token past them crossed once (a block not yet full by token slot).
        assert num_bytes == num_tokens * KV_BYTES_PER_TOKEN
        assert (sent - 2) * BLOCK_SIZE < num_tokens <= sent * BLOCK_SIZE
    # So each move saved at least its cached prefix (a blind move sends the whole lease), and
    # the prefix is there to save. (How much that is of the whole depends on how many tokens
    # were decoded before the move, i.e. on timing: a slow machine migrates later. No ratio.)
    assert prompt_blocks - 2 > 0, prompt_blocks


async def test_pairing_takes_the_destination_that_holds_the_prefix(cluster, llumlets, tiny_model_dir):
    """Two equally free destinations; the one that would win the freeness tie (its id sorts
    first, and it opens first) holds nothing, the other the requests' shared prefix: the scheduler
    pairs the loaded instance with the one holding the prefix, as the source's load report names it."""
    args = ("--sim-num-blocks", "300", "--sim-kv-bytes-per-token", str(KV_BYTES_PER_TOKEN), "--sim-prefix-caching")
    loaded = llumlets(*args, "--migration-min-residence-s", "1.5")  # nothing moves before both are open
    suffix = loaded[2:]
    cold, warm = f"a-cold-{suffix}", f"z-warm-{suffix}"  # the tie goes to the smaller id
    for instance_id in (cold, warm):
        cluster.start_llumlet(instance_id, *SIM, *args)
    try:
        async with Watch(cluster.nats_url) as watch:
            await wait_ready(cluster, watch, loaded, cold, warm)
            model = model_name(cluster)
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
                for instance_id in (loaded, cold):
                    await watch.order(instance_id, DrainOrder(drain=True))
                assert await watch.wait_for(lambda latest: latest[loaded].draining and latest[cold].draining, 5)
                first = await stream_chat(http, model, f"{SHARED} warm-up", 4)
                assert first["error"] is None and watch.publishers(first["id"]) == [warm]
                await watch.order(loaded, DrainOrder(drain=False))
                await watch.order(warm, DrainOrder(drain=True))
                assert await watch.wait_for(lambda latest: latest[warm].draining and not latest[loaded].draining, 5)
                requests = [asyncio.create_task(stream_chat(http, model, f"{SHARED} question {i}", 900))
                            for i in range(8)]
                assert await watch.wait_for(lambda latest: latest[loaded].num_running == 8, 10)
                await watch.order(cold, DrainOrder(drain=False))
                assert await watch.wait_for(lambda latest: not latest[cold].draining, 5)
                await watch.order(warm, DrainOrder(drain=False))
                results = await asyncio.gather(*requests)
            assert await watch.wait_finished(*(r["id"] for r in results))
            vocab, eos, _ = model_vocabulary(str(tiny_model_dir))
            tokens = SyntheticTokens(vocab, eos, seed=0)
            for result in results:
                assert result["error"] is None
                key = tokens.key(result["id"])
                assert watch.tokens(result["id"]) == [tokens.token(key, i) for i in range(900)]
    finally:
        for instance_id in (cold, warm):
            cluster.procs[instance_id].terminate()
    moves = [m.groups() for m in MIGRATED.finditer(cluster.procs[loaded].log())]
    assert moves, "no request migrated"
    _, first_dst, *_, first_cached = moves[0]
    assert first_dst == warm and int(first_cached) > 0, moves
