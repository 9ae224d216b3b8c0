"""A migrated request takes its lease's full blocks as they are (vLLM's prefix cache), so its
first step on the destination copies only the partial last block, whatever its length.

Runs in a subprocess (vLLM's KV connector state is process-wide), on one engine with prefix
caching on: a request is suspended, its KV copied out, the engine's prefix cache emptied (so no
block of the original can serve the hit), the KV copied into a lease and the request committed
there. The connector's copies are counted; zeroed full blocks in the lease must change the
output, so the request really reads the adopted blocks.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
SELF_CHECK_PREFIX = "SELF-CHECK "
BLOCK_SIZE, OUTPUT_LEN, MOVE_AT = 32, 80, 30  # 70 prompt + 30 output tokens: 3 full blocks and a partial one


def test_migrated_request_adopts_its_full_lease_blocks(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "tests.vllm.test_vllm_lease_adoption", str(tiny_model_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith(SELF_CHECK_PREFIX)]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[0].removeprefix(SELF_CHECK_PREFIX))
    assert result["migrated_matches"], result
    assert result["full_blocks"] == 3, result
    # Only the partial block goes through the connector; the full ones are the lease's own.
    assert result["copied_blocks"]["migrated"] == 1, result
    assert not result["zeroed_matches"], "zeroed full lease blocks gave the same tokens: they were not read"
    # Pinned blocks of another prompt: not adopted (it ended the engine), the request computed again.
    assert result["foreign_pinned"] == 2 and result["foreign_matches"], result
    assert result["free_after"] == result["free_before"] and result["reserved_after"] == 0, result


async def _self_check(model_dir: str) -> dict:
    from services.llumlet.engines.vllm.connector import CorralMigrationConnector
    from services.llumlet.engines.vllm.engine import VllmEngine, VllmEngineConfig
    from services.llumlet.migration.copier import BlockCopier
    from shared.messages import GenerateRequest, SamplingParams

    copied: dict[str, int] = defaultdict(int)
    load = CorralMigrationConnector.start_load_kv

    def counting_load(self, forward_context, **kwargs):  # the copies each request's first step makes
        meta = self._get_connector_metadata()
        for internal_id in meta.loaded:
            copied[internal_id.split("-")[0]] += len(meta.copies)
        load(self, forward_context, **kwargs)

    CorralMigrationConnector.start_load_kv = counting_load
    engine = VllmEngine(VllmEngineConfig(model_dir=model_dir, max_model_len=512, block_size=BLOCK_SIZE,
                                         kv_cache_space_gib=64 * BLOCK_SIZE * 1024 / (1 << 30),
                                         enable_prefix_caching=True))
    await engine.start()
    ops = engine.migration_ops()
    copier = BlockCopier(ops.kv_regions())
    tokens: dict[str, dict[int, int]] = defaultdict(dict)
    finished: set[str] = set()
    prompt = [(7 * i) % 300 + 3 for i in range(70)]

    async def step_until(predicate) -> None:
        while not predicate():
            for out in await engine.step():
                tokens[out.request_id].update((out.start_index + i, t) for i, t in enumerate(out.token_ids))
                if out.finish_reason is not None:
                    finished.add(out.request_id)

    def add(request_id: str) -> None:
        engine.add_request(GenerateRequest(request_id, prompt, SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0,
                                                                             ignore_eos=True), "unused"))

    def output(request_id: str) -> list[int | None]:
        return [tokens[request_id].get(i) for i in range(OUTPUT_LEN)]

    async def empty_prefix_cache() -> None:
        assert await engine.on_engine_thread(lambda driver: driver.llm_engine.reset_prefix_cache())

    async def migrate_in_place(request_id: str, zero_full_blocks: bool = False) -> int:
        """Suspend, copy everything out, forget the cache, copy into a lease, commit there."""
        await step_until(lambda: len(tokens[request_id]) >= MOVE_AT)
        assert await ops.suspend(request_id)
        blocks = ops.block_ids_of(request_id)
        full = ops.migration_snapshot(request_id).num_computed_tokens // BLOCK_SIZE
        payload = bytearray(await copier.gather(blocks, 0))
        commit = ops.migration_commit(request_id, f"m-{request_id}")
        assert await ops.release_migrated(request_id)
        await empty_prefix_cache()
        if zero_full_blocks:
            payload[: full * copier.block_bytes] = bytes(full * copier.block_bytes)
        lease = f"lease-{request_id}"
        await copier.scatter(await ops.reserve_blocks(lease, len(blocks)), bytes(payload))
        ops.add_migrated(commit, lease)
        return full

    async def migrate_onto_foreign_pins() -> int:
        """A lease whose first blocks are another prompt's cached ones (a source naming the wrong
        hashes): the add must not read them; the request is computed again from its tokens."""
        from shared.prefix_hash import block_hashes

        await empty_prefix_cache()  # (the zeroed request's blocks are cached under the prompt's hashes)
        add("foreign")
        await step_until(lambda: len(tokens["foreign"]) >= MOVE_AT)
        assert await ops.suspend("foreign")
        blocks = ops.block_ids_of("foreign")
        payload = bytes(await copier.gather(blocks, 0))
        commit = ops.migration_commit("foreign", "m-foreign")
        assert await ops.release_migrated("foreign")
        await empty_prefix_cache()
        other = [(11 * i) % 300 + 5 for i in range(70)]
        engine.add_request(GenerateRequest("other", other, SamplingParams(max_tokens=1, temperature=0.0), "unused"))
        await step_until(lambda: "other" in finished)
        pinned = await ops.pin_cached_prefix("lease-foreign", block_hashes(other, BLOCK_SIZE), len(blocks) - 1)
        reserved = await ops.reserve_blocks("lease-foreign", len(blocks) - len(pinned))
        await copier.scatter(reserved, payload[len(pinned) * copier.block_bytes:])
        ops.add_migrated(commit, "lease-foreign")
        return len(pinned)

    add("reference")
    await step_until(lambda: "reference" in finished)
    await empty_prefix_cache()
    free_before = engine.num_free_blocks()
    add("migrated")
    full_blocks = await migrate_in_place("migrated")
    await step_until(lambda: "migrated" in finished)
    await empty_prefix_cache()
    add("zeroed")
    await migrate_in_place("zeroed", zero_full_blocks=True)
    await step_until(lambda: "zeroed" in finished)
    foreign = await migrate_onto_foreign_pins()
    await step_until(lambda: "foreign" in finished)
    await step_until(lambda: not engine.has_work())
    await engine.on_engine_thread(lambda driver: None)
    result = {
        "migrated_matches": output("migrated") == output("reference"),
        "zeroed_matches": output("zeroed") == output("reference"),
        "foreign_pinned": foreign,
        "foreign_matches": output("foreign") == output("reference"),
        "full_blocks": full_blocks,
        "copied_blocks": dict(copied),
        "free_before": free_before,
        "free_after": engine.num_free_blocks(),
        "reserved_after": ops.num_reserved_blocks(),
    }
    await engine.stop()
    return result


if __name__ == "__main__":
    print(SELF_CHECK_PREFIX + json.dumps(asyncio.run(_self_check(sys.argv[1]))), flush=True)
