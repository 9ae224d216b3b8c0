"""SimEngine: the simulated inference engine a llumlet drives (the `Engine` protocol).

A thin asyncio wrapper around the synchronous `SimScheduler`: each step schedules, sleeps for
the latency model's step time × `time_scale`, applies the step, writes the computed tokens' KV
pattern (when a pool is configured) and returns the new synthetic tokens. Its migration verbs
live in `migration.py` (`migration_ops()`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shared.prefix_hash import block_hashes
from shared.engine_model.views import EngineError, RequestView, StepOutput
from shared.engine_model.kv_pool import KVPool, request_key
from shared.engine_model.latency import LatencyModel
from shared.engine_model.request import RequestStatus, SimRequest
from services.llumlet.engines.sim.config import SimEngineConfig  # (its home; imported from here too)
from shared.engine_model.scheduler import SimScheduler
from services.llumlet.engines.sim.migration import SimMigration
from services.llumlet.kv_journal import KvEventJournal
from shared.messages import GenerateRequest

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_IDLE_STEP_S = 0.005  # unscaled pause of a step that could schedule nothing (e.g. blocks reserved)
_MIN_IDLE_SLEEP_S = 0.001  # never spin, whatever the time scale


class SyntheticTokens:
    """Deterministic token ids from (seed, request id, index): the same stream on any instance,
    so a migrated request continues exactly where it would have. Never draws `eos_token_id`."""

    def __init__(self, vocab_size: int, eos_token_id: int | None, seed: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.seed = seed

    def key(self, request_id: str) -> int:
        return request_key(request_id, self.seed)

    def token(self, key: int, index: int) -> int:
        x = (key + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64  # splitmix64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
        eos = self.eos_token_id
        if eos is None:
            return x % self.vocab_size
        token = x % (self.vocab_size - 1)
        return token + 1 if token >= eos else token


class SimEngine:
    kind = "sim"

    def __init__(self, config: SimEngineConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config = config or SimEngineConfig()
        self.model_name = config.model_name
        self.block_size = config.scheduler.block_size
        self.num_blocks_total = config.scheduler.num_blocks
        self.max_model_len = config.scheduler.max_model_len
        self.scheduler = SimScheduler(config.scheduler)
        self.latency = LatencyModel(config.gpu, fine=config.fine_latency)
        self.kv_pool: KVPool | None = None
        if config.kv_bytes_per_token:
            self.kv_pool = KVPool(config.scheduler.num_blocks, config.scheduler.block_size, config.kv_bytes_per_token)
        self.tokens = SyntheticTokens(config.vocab_size, config.eos_token_id, config.seed)
        self._clock = clock
        self._inputs: dict[str, GenerateRequest] = {}  # live requests as they came in
        self._keys: dict[str, int] = {}
        self._migration = SimMigration(self)
        self.stepping = False  # a step is in flight (scheduled, not yet applied)
        self._at_step_end: list[Callable[[], None]] = []

    # -- Engine protocol -----------------------------------------------------------------------

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def add_request(self, request: GenerateRequest) -> None:
        self.admit(request, self.to_sim(request))

    def abort_request(self, request_id: str) -> bool:
        aborted = self.scheduler.abort_request(request_id, self._clock())
        self.forget(request_id)
        return aborted is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    async def step(self) -> list[StepOutput]:
        self.stepping = True
        try:
            return await self._step()
        finally:  # (before the caller can schedule the next step)
            self.stepping = False
            callbacks, self._at_step_end = self._at_step_end, []
            for callback in callbacks:
                callback()

    def at_step_end(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the step in flight has applied its output, before the next step
        schedules; at once when no step is in flight."""
        if self.stepping:
            self._at_step_end.append(callback)
        else:
            callback()

    async def _step(self) -> list[StepOutput]:
        started = time.monotonic()
        out = self.scheduler.schedule(self._clock())
        if out.is_empty:
            # Nothing fits (blocks held by reservations) or everything was just preempted.
            await asyncio.sleep(0 if out.preempted else max(_IDLE_STEP_S * self.config.time_scale, _MIN_IDLE_SLEEP_S))
            return []
        await asyncio.sleep(self.latency.step_time_of(out) * self.config.time_scale)
        if self.kv_pool is not None:
            self._write_kv(out.requests, out.num_new_tokens)
        events = self.scheduler.update_from_output(out, self._clock())
        outputs = [self._emit(request) for request in events.new_token]
        for request in events.finished:
            self.forget(request.request_id)
        self._migration.stepped([o.request_id for o in outputs], started)
        return outputs

    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free

    def num_committed_blocks(self) -> int:
        return self.scheduler.committed_blocks()

    def waiting_prefill_tokens(self) -> int | None:
        return self.scheduler.waiting_prefill_tokens()

    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions_total

    def request_views(self) -> list[RequestView]:
        return self.scheduler.request_views()

    def migration_ops(self) -> SimMigration:
        return self._migration

    def kv_event_journal(self) -> KvEventJournal | None:
        """What the prefix cache holds, as it changes (None when this engine does not cache)."""
        cache = self.scheduler.prefix_cache
        if cache is None:
            return None
        if cache.listener is None:
            journal = KvEventJournal()
            journal.stored(cache.held_hashes())
            cache.listener = journal
        return cache.listener

    # -- views for tests and the migration verbs ------------------------------------------------

    def num_reserved_blocks(self) -> int:
        return self.scheduler.block_manager.num_reserved

    def get_request(self, request_id: str) -> SimRequest | None:
        return self.scheduler.get(request_id)

    def block_ids_of(self, request_id: str) -> list[int]:
        return self.scheduler.block_ids_of(request_id)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block in a fused KV buffer (0 when the engine keeps no KV bytes)."""
        return 0 if self.kv_pool is None else self.kv_pool.block_bytes

    # -- what the migration verbs use (`SimEngineParts`) -----------------------------------------

    def now(self) -> float:
        return self._clock()

    def input_of(self, request_id: str) -> GenerateRequest:
        return self._inputs[request_id]

    def to_sim(self, request: GenerateRequest) -> SimRequest:
        sampling = request.sampling
        if not request.prompt_token_ids:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if sampling.max_tokens < 1:
            raise EngineError(f"request {request.request_id}: max_tokens must be at least 1")
        if sampling.logprobs is not None:  # its tokens are drawn from a hash, not from probabilities
            raise EngineError("logprobs need the vLLM engine: the simulated engine has no probabilities to report")
        target = request.target_output_len
        if target is not None:
            target = max(target, sampling.min_tokens)  # a trace's "EOS" cannot come before min_tokens
        return SimRequest(
            request_id=request.request_id,
            prompt_len=len(request.prompt_token_ids),
            max_tokens=sampling.max_tokens,
            target_output_len=target,
            priority=request.priority,
            arrival_time=request.arrival_time or self._clock(),
            # The gateway's chain (shared.prefix_hash) over the prompt, when this engine caches.
            block_hashes=tuple(block_hashes(request.prompt_token_ids, self.block_size))
            if self.scheduler.prefix_cache is not None else (),
        )

    def admit(self, request: GenerateRequest, sim: SimRequest, migrated_lease: str | None = None) -> None:
        """Into the scheduler: a new request, or a migrated one on the lease's blocks."""
        if migrated_lease is None:
            self.scheduler.add_request(sim)
        elif not self.scheduler.add_migrated(sim, migrated_lease):
            log.warning("migrated request %s: the blocks its source named as cached here are not its prefix; "
                        "its KV is computed again from its tokens", request.request_id)
        self._inputs[request.request_id] = request
        self._keys[request.request_id] = self.tokens.key(request.request_id)

    def forget(self, request_id: str) -> None:
        self._inputs.pop(request_id, None)
        self._keys.pop(request_id, None)

    # -- internals -----------------------------------------------------------------------------

    def _write_kv(self, requests: list[SimRequest], num_new_tokens: list[int]) -> None:
        assert self.kv_pool is not None
        for request, num_new in zip(requests, num_new_tokens):
            if request.status is RequestStatus.RUNNING:  # skip those aborted/suspended mid-step
                start = request.num_computed_tokens
                blocks = self.scheduler.block_ids_of(request.request_id)
                self.kv_pool.write_tokens(self._keys[request.request_id], blocks, start, start + num_new)

    def _emit(self, request: SimRequest) -> StepOutput:
        index = request.num_output_tokens - 1
        # A resumed request's prompt ends with its output so far: its synthetic stream goes on
        # from there, as a model's continuation of that text would.
        resumed = self._inputs[request.request_id].resume_from
        token = self.tokens.token(self._keys[request.request_id], index + resumed)
        request.output_token_ids.append(token)
        return StepOutput(
            request_id=request.request_id,
            start_index=index,
            token_ids=[token],
            finish_reason=request.finish_reason if request.is_finished else None,
            num_prompt_tokens=request.prompt_len,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens if self.scheduler.prefix_cache is not None else None,
        )
