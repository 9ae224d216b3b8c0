from __future__ import annotations

import random

import pytest

from services.llumlet.engine import Engine
from services.llumlet.migration.ops import MigratableEngine
from shared.engine_model.views import EngineError, StepOutput
from services.llumlet.engines.sim.engine import SimEngine, SimEngineConfig
from shared.engine_model.config import SchedulerConfig
from shared.engine_model.request import RequestStatus
from shared.messages import FinishReason, GenerateRequest, SamplingParams
from tests.unit.migration_helpers import export_kv, import_kv, sim_config, verify_kv

FAST = dict(time_scale=1e-5, num_blocks=64, block_size=4, max_model_len=512)


def gen(rid: str, prompt: int, max_tokens: int, **kwargs) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=kwargs.pop("ignore_eos", False))
    return GenerateRequest(rid, list(range(1, prompt + 1)), sampling, reply_subject="out", **kwargs)


async def drain(engine: SimEngine, max_steps: int = 100_000) -> dict[str, list[StepOutput]]:
    streams: dict[str, list[StepOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return streams
        for output in await engine.step():
            streams.setdefault(output.request_id, []).append(output)
    raise AssertionError("engine did not drain")


def tokens_of(stream: list[StepOutput]) -> list[int]:
    assert [o.start_index for o in stream] == list(range(len(stream)))  # contiguous indices
    return [t for o in stream for t in o.token_ids]


def test_sim_engine_satisfies_the_engine_protocol() -> None:
    engine = SimEngine(sim_config(**FAST))
    assert isinstance(engine, Engine) and engine.kind == "sim"
    assert isinstance(engine.migration_ops(), MigratableEngine) and engine.migration_ops() is engine.migration_ops()
    assert engine.num_blocks_total == 64 and engine.block_size == 4 and engine.max_model_len == 512


async def test_fifty_requests_finish_with_max_tokens_and_blocks_return() -> None:
    engine = SimEngine(sim_config(**FAST, max_num_batched_tokens=128))
    await engine.start()
    baseline = engine.num_free_blocks()
    rng = random.Random(7)
    wanted = {}
    for i in range(50):
        wanted[f"r{i}"] = rng.randint(1, 30)
        engine.add_request(gen(f"r{i}", rng.randint(1, 60), wanted[f"r{i}"]))
    streams = await drain(engine)
    await engine.stop()
    assert {rid: len(tokens_of(s)) for rid, s in streams.items()} == wanted
    for stream in streams.values():
        assert [o.finish_reason for o in stream] == [None] * (len(stream) - 1) + [FinishReason.LENGTH]
    assert engine.num_free_blocks() == baseline
    assert engine.num_preemptions_total() > 0  # 64 blocks of 4 tokens are not enough for all at once
    assert engine.request_views() == []


async def test_trace_target_length_stops_with_stop_reason() -> None:
    engine = SimEngine(sim_config(**FAST))
    engine.add_request(gen("r", 10, 50, target_output_len=7))
    streams = await drain(engine)
    assert len(tokens_of(streams["r"])) == 7 and streams["r"][-1].finish_reason is FinishReason.STOP
    assert streams["r"][0].num_prompt_tokens == 10


async def test_tokens_are_deterministic_and_never_eos() -> None:
    config = sim_config(**FAST, vocab_size=5, eos_token_id=2, seed=3)
    runs = []
    for _ in range(2):
        engine = SimEngine(config)
        engine.add_request(gen("r", 4, 200))
        runs.append(tokens_of((await drain(engine))["r"]))
    assert runs[0] == runs[1]
    assert 2 not in runs[0] and set(runs[0]) == {0, 1, 3, 4}
    other_seed = SimEngine(sim_config(**{**FAST, "seed": 4}))
    other_seed.add_request(gen("r", 4, 200))
    assert tokens_of((await drain(other_seed))["r"]) != runs[0]


def test_bad_requests_raise_engine_error() -> None:
    engine = SimEngine(sim_config(**FAST))
    with pytest.raises(EngineError):
        engine.add_request(gen("empty", 0, 5))
    with pytest.raises(EngineError):
        engine.add_request(gen("too-long", 512, 5))
    with pytest.raises(EngineError):
        engine.add_request(gen("no-tokens", 5, 0))
    engine.add_request(gen("dup", 5, 5))
    with pytest.raises(EngineError):
        engine.add_request(gen("dup", 5, 5))


async def test_abort_is_idempotent_and_frees_blocks() -> None:
    engine = SimEngine(sim_config(**FAST, max_num_seqs=2))
    for rid in ("a", "b", "c"):
        engine.add_request(gen(rid, 10, 20))
    await engine.step()
    assert await engine.migration_ops().suspend("b")
    assert [engine.abort_request(rid) for rid in ("a", "b", "c")] == [True, True, True]  # running, suspended, waiting
    assert not engine.abort_request("a")
    assert engine.num_free_blocks() == 64 and not engine.has_work()


async def test_migration_moves_kv_and_continues_the_same_token_stream() -> None:
    config = sim_config(**FAST, kv_bytes_per_token=32)
    reference = SimEngine(config)
    reference.add_request(gen("r", 30, 40))
    expected = tokens_of((await drain(reference))["r"])

    src, dst = SimEngine(config), SimEngine(config)
    src_ops, dst_ops = src.migration_ops(), dst.migration_ops()
    src.add_request(gen("r", 30, 40))
    outputs = [o for _ in range(5) for o in await src.step()]
    # Stage 1 copies what exists while the request keeps decoding.
    stage1 = src.block_ids_of("r")
    dst_blocks = await dst_ops.reserve_blocks("mig", len(stage1))
    fused = export_kv(src, stage1).tobytes()
    assert len(fused) == len(stage1) * src.kv_block_bytes == len(stage1) * 4 * 32
    import_kv(dst, dst_blocks, fused)
    outputs += [o for _ in range(6) for o in await src.step()]
    # Last stage: out of the batch, copy the last partial block again plus the new ones.
    assert await src_ops.suspend("r")
    blocks = src.block_ids_of("r")
    resend = blocks[len(stage1) - 1 :]
    new_dst = await dst_ops.reserve_blocks("mig", len(blocks) - len(stage1))
    import_kv(dst, [dst_blocks[-1], *new_dst], export_kv(src, resend))
    commit = src_ops.migration_commit("r", "mig")
    dst_ops.add_migrated(commit, "mig")
    assert verify_kv(dst, "r")
    assert await src_ops.release_migrated("r") and src.num_free_blocks() == 64
    assert not src.has_work() and await src.step() == []
    outputs += [o for s in (await drain(dst)).values() for o in s]
    assert tokens_of(outputs) == expected and outputs[-1].finish_reason is FinishReason.LENGTH
    assert dst.num_free_blocks() == 64 and dst.num_reserved_blocks() == 0


async def test_corrupted_migration_fails_verification() -> None:
    config = sim_config(**FAST, kv_bytes_per_token=16)
    src, dst = SimEngine(config), SimEngine(config)
    src.add_request(gen("r", 20, 40))
    for _ in range(3):
        await src.step()
    await src.migration_ops().suspend("r")
    blocks = src.block_ids_of("r")
    fused = export_kv(src, blocks).copy()
    fused[0, 0] ^= 0xFF
    import_kv(dst, await dst.migration_ops().reserve_blocks("m", len(blocks)), fused)
    dst.migration_ops().add_migrated(src.migration_ops().migration_commit("r", "m"), "m")
    assert verify_kv(src, "r") and not verify_kv(dst, "r")


async def test_aborted_migration_resumes_on_the_source() -> None:
    engine = SimEngine(sim_config(**FAST))
    engine.add_request(gen("r", 10, 12))
    await engine.step()
    ops = engine.migration_ops()
    assert await ops.suspend("r")
    assert await engine.step() == []  # out of the batch
    assert engine.get_request("r").status == RequestStatus.SUSPENDED
    assert await ops.resume("r")
    streams = await drain(engine)
    assert len(streams["r"]) == 11  # the first token came from the step before the suspension


def test_simulator_mode_has_no_kv_pool() -> None:
    engine = SimEngine(sim_config(**{**FAST, "kv_bytes_per_token": 0}))
    assert engine.kv_pool is None
    assert export_kv(engine, [1, 2]).nbytes == 0 and engine.kv_block_bytes == 0


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError):
        SimEngineConfig(kv_bytes_per_token=12)
    with pytest.raises(ValueError):
        SimEngineConfig(eos_token_id=40_000)
    with pytest.raises(ValueError):
        SimEngineConfig(SchedulerConfig(queue_policy="random"))
