"""Logprobs across a live migration on the real vLLM engine, with the race forced: the request is
suspended right after a step, and that step's chunk from the source reaches the gateway only
after the client has read the destination's catch-up. The commit carries the source's last-step
logprobs, so every token of the stream still has its own; without them those tokens are null.

The migration is a self-migration on one engine (as the adapter check in test_vllm_migration):
KV copied into a lease, commit, release, add; the stream is the gateway's `OutputStream`.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from services.gateway.streams import OutputStream
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration_hooks import catch_up_chunks
from shared.engine_model.views import StepOutput
from shared.messages import MigrationCommit, TokenChunk, TokenLogprob, decode, decode_chunks, encode
from tests.vllm.test_vllm_engine import make_request, random_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

OUTPUT_LEN = 24
TOP = 2


def chunk_of(instance_id: str, output: StepOutput) -> TokenChunk:
    """What the llumlet's OutputPublisher sends for a step output (no resume offset here)."""
    return TokenChunk(output.request_id, instance_id, output.start_index, output.token_ids,
                      finish_reason=output.finish_reason, logprobs=output.logprobs)


async def steps(engine, request_id: str) -> list[StepOutput]:
    return [o for o in await engine.step() if o.request_id == request_id]


async def migrate_with_late_source_chunk(engine, request_id: str,
                                         strip_tail: bool) -> tuple[dict[int, TokenLogprob | None], int]:
    """Run `request_id` to the end with one self-migration mid-decode, feeding a gateway stream
    in the racy order: the logprob each token index reached the client with, and how many
    tokens the late chunk held."""
    ops = engine.migration_ops()
    copier = BlockCopier(ops.kv_regions())
    engine.add_request(make_request(request_id, random_prompt(40, seed=21), temperature=0.0, max_tokens=OUTPUT_LEN,
                                    ignore_eos=True, logprobs=TOP))
    stream = OutputStream(request_id, "src")
    seen: dict[int, TokenLogprob | None] = {}

    async def read_all() -> None:  # the client reads whatever is queued
        while True:
            try:
                delivery = await stream.next(0.01)
            except TimeoutError:
                return
            start = len(seen)
            for i, token_id in enumerate(delivery.token_ids):
                seen[start + i] = None if delivery.logprobs is None else delivery.logprobs[i]

    source_outputs: list[StepOutput] = []
    while sum(len(o.token_ids) for o in source_outputs) < 10:
        source_outputs += await steps(engine, request_id)
    *published, last = source_outputs
    for output in published:
        stream.feed(chunk_of("src", output))
    await read_all()

    # Right after that step: its chunk (`last`) is still on its way when the commit lands.
    assert await ops.suspend(request_id)
    commit = decode(encode(ops.migration_commit(request_id, f"m-{request_id}")), MigrationCommit)  # over the wire
    assert commit.tail_logprobs == last.logprobs, "the commit carries the source's last step's logprobs"
    if strip_tail:
        commit = msgspec.structs.replace(commit, tail_logprobs=None)
    block_ids = ops.block_ids_of(request_id)
    lease = f"lease-{request_id}"
    await copier.scatter(await ops.reserve_blocks(lease, len(block_ids)), await copier.gather(block_ids, 0))
    assert await ops.release_migrated(request_id)
    ops.add_migrated(commit, lease)

    for chunk in catch_up_chunks("dst", commit):
        for decoded in decode_chunks(encode(chunk)):
            stream.feed(decoded)
    await read_all()
    stream.feed(chunk_of("src", last))  # the source's late chunk: the client has read those tokens
    while not stream.finished:
        for output in await steps(engine, request_id):
            stream.feed(chunk_of("dst", output))
        await read_all()
    assert len(seen) == OUTPUT_LEN and stream.holders == ["src", "dst"]
    return seen, len(last.token_ids)


async def test_every_token_of_a_migrated_stream_has_its_logprobs_though_the_source_s_last_chunk_is_late(vllm_engine):
    seen, _ = await migrate_with_late_source_chunk(vllm_engine, "lp-race", strip_tail=False)
    missing = [i for i, logprob in seen.items() if logprob is None]
    assert not missing, f"tokens {missing} reached the client with null logprobs"
    for logprob in seen.values():
        values = [v for _, v in logprob.top]
        assert len(values) == TOP and values == sorted(values, reverse=True)
        assert math.isclose(logprob.logprob, values[0])  # greedy: the sampled token is the best


async def test_without_the_commit_s_tail_the_race_leaves_the_late_tokens_null(vllm_engine):
    """The race is real: the same order, with the commit carrying no logprobs, loses them."""
    seen, num_late = await migrate_with_late_source_chunk(vllm_engine, "lp-race-bare", strip_tail=True)
    missing = [i for i, logprob in seen.items() if logprob is None]
    assert len(missing) == num_late >= 1


# -- end to end: two vLLM llumlets, the request moved mid-stream over NATS and the KV link -------


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    from tests.support.cluster import running_cluster
    from tests.vllm.test_vllm_migration import INSTANCES, LLUMLET

    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("vllm-migration-logprobs"), INSTANCES, *LLUMLET,
                         engine="vllm", scheduler_args=["--no-enable-migration"], timeout_s=240) as cluster:
        yield cluster


async def test_a_stream_moved_between_two_vllm_llumlets_keeps_every_logprob(cluster):
    import asyncio

    import openai

    from tests.vllm.test_vllm_migration import INSTANCES, Watch

    output_len = 1200
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id

    async def chat() -> list:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me about corrals"}], max_tokens=output_len,
            temperature=0.0, logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
        return [entry async for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]

    async with Watch(cluster.nats_url) as watch:
        reference = await chat()
        # The client can have the whole reply before this watch has the last chunk: until the
        # watch sees it end, the reference would pass for the live request (and the order would
        # go to its instance, which may hold nothing to move).
        (reference_id,) = watch.chunks
        assert await watch.wait_finished(reference_id)
        task = asyncio.create_task(chat())
        assert await watch.until(lambda: watch.live_request() is not None, 30)
        request_id = watch.live_request()
        assert await watch.until(lambda: len(watch.tokens(request_id, contiguous=False)) >= output_len // 4, 60)
        src = watch.publishers(request_id)[-1]
        await watch.move(request_id, src, next(i for i in INSTANCES if i != src))
        moved = await task
        assert await watch.wait_finished(request_id)
    await client.close()

    assert len(watch.publishers(request_id)) == 2
    # The destination's catch-up sent the source's last step with its logprobs (from the commit).
    handovers = [c for c in watch.chunks[request_id] if c.handover]
    assert any(c.logprobs for c in handovers), handovers
    assert len(moved) == output_len and all(e.logprob is not None and len(e.top_logprobs) == 2 for e in moved)
    assert [e.token for e in moved] == [e.token for e in reference]  # greedy: the same tokens, moved or not
