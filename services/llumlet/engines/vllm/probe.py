"""Access to the internals of an in-process vLLM v1 engine (pinned: vllm 0.32.0).

vLLM has no public API for its scheduler's state, so every path into its internals lives here and
nowhere else: when the pinned version moves, this is the file to re-check against the source
(`vllm/v1/core/sched/scheduler.py`, `vllm/v1/core/kv_cache_manager.py`, `vllm/v1/core/block_pool.py`).
Call it only on the engine thread: none of these structures is thread-safe against `step()`.
Reads only, but for `free_held_blocks` (migration).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any


class SchedulerProbe:
    def __init__(self, llm_engine: Any) -> None:
        # LLMEngine -> InprocClient -> EngineCore -> Scheduler (in-process mode only).
        self.scheduler = llm_engine.engine_core.engine_core.scheduler
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        self.block_pool = self.kv_cache_manager.block_pool
        self.block_size: int = self.scheduler.block_size
        # Block 0 is vLLM's null block: never allocated, never free.
        self.num_blocks_total: int = self.block_pool.num_gpu_blocks - 1

    @property
    def prefix_caching(self) -> bool:
        return bool(self.kv_cache_manager.enable_caching)

    def set_kv_event_publisher(self, publisher: Any) -> None:
        """The object the scheduler hands each step's KV-event batch to (`publish(batch)`); the
        block pool queues events only when the engine was built with KV events enabled."""
        self.scheduler.kv_event_publisher = publisher

    def num_free_blocks(self) -> int:
        """Free blocks, counting cached-but-unreferenced prefix blocks (vLLM evicts them on demand)."""
        return self.block_pool.get_num_free_blocks()

    def num_blocks_of(self, internal_id: str) -> int:
        # One KV cache group for a plain decoder (Llama); hybrid models would have several.
        groups = self.kv_cache_manager.get_block_ids(internal_id)
        return max((len(ids) for ids in groups), default=0)

    def request(self, internal_id: str) -> Any | None:
        """vLLM's `Request` object; it keeps its counters (num_preemptions) after it finishes."""
        return self.scheduler.requests.get(internal_id)

    def waiting(self) -> Iterator[Any]:
        """Queued requests in the order `schedule()` takes them: block holders first."""
        return itertools.chain(self.scheduler.kv_holding_waiting, self.scheduler.waiting)

    def running(self) -> list[Any]:
        return list(self.scheduler.running)

    def free_held_blocks(self, internal_id: str) -> bool:
        """Free the blocks of a finished request that the KV connector held (`request_finished`
        returned True): what vLLM does when `get_finished` reports it sent, but at once, without
        waiting for a step (an idle engine does not step)."""
        request = self.scheduler.requests.get(internal_id)
        if request is None or not request.is_finished():
            return False
        self.scheduler._free_blocks(request)
        return True
