"""Shared pieces of the migration tests: simulated engines with KV bytes, requests, a fake clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import numpy as np

from services.llumlet.engines.sim.engine import SimEngine, SimEngineConfig
from shared.engine_model.config import SchedulerConfig
from shared.messages import GenerateRequest, SamplingParams

BLOCK_SIZE = 4
KV_BYTES_PER_TOKEN = 64
_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}


def sim_config(**overrides) -> SimEngineConfig:
    """A small, fast simulated engine; local-scheduler settings (num_blocks=...) go to its scheduler."""
    settings = {**dict(time_scale=1e-5, num_blocks=64, block_size=BLOCK_SIZE, max_model_len=512,
                       kv_bytes_per_token=KV_BYTES_PER_TOKEN), **overrides}
    scheduler = {name: settings.pop(name) for name in list(settings) if name in _SCHEDULER_FIELDS}
    return SimEngineConfig(SchedulerConfig(**scheduler), **settings)


def gen(rid: str, prompt: int, max_tokens: int, reply_subject: str = "out", priority: int = 0) -> GenerateRequest:
    return GenerateRequest(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                           reply_subject=reply_subject, priority=priority)


async def decode_steps(engine: SimEngine, steps: int) -> list:
    return [o for _ in range(steps) for o in await engine.step()]


def export_kv(engine: SimEngine, block_ids: Sequence[int]) -> np.ndarray:
    """A source's blocks by hand: their bytes fused into one buffer (empty without KV bytes)."""
    if engine.kv_pool is None:
        return np.zeros((len(block_ids), 0), dtype=np.uint8)
    return engine.kv_pool.gather(block_ids)


def import_kv(engine: SimEngine, block_ids: Sequence[int], buffer: np.ndarray | bytes | memoryview) -> None:
    """A destination's (reserved) blocks written by hand from a fused buffer."""
    if engine.kv_pool is not None:
        engine.kv_pool.scatter(block_ids, buffer)


def verify_kv(engine: SimEngine, request_id: str) -> bool:
    """The request runs on `engine` and its computed tokens' blocks hold the bytes its tokens
    write (what a migration must have copied); True for an engine without KV bytes."""
    request = engine.get_request(request_id)
    if request is None:
        return False
    if engine.kv_pool is None:
        return True
    return engine.kv_pool.verify(engine.tokens.key(request_id), engine.block_ids_of(request_id),
                                 request.num_computed_tokens)


def expected_tokens(engine: SimEngine, request_id: str, count: int) -> list[int]:
    """The synthetic stream of a request: the same on every instance (seeded by its id)."""
    key = engine.tokens.key(request_id)
    return [engine.tokens.token(key, i) for i in range(count)]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
