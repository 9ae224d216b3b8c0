"""The local scheduler's settings, in one place: the llumlet's simulated engine, the simulator
and the benchmarks compose this one dataclass (its defaults are the A10 testbed's)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine_model.queues import QUEUE_POLICIES

STEP_MODES = ("v1", "v0")


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int = 851  # A10 with LLaMA-7B at gpu_memory_utilization 0.9
    block_size: int = 16
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    queue_policy: str = "fcfs"
    step_mode: str = "v1"
    enable_chunked_prefill: bool = True  # v1 only; v0 always prefills whole prompts
    # Kept free when admitting next to requests already running (vLLM v0 used 1 % of the blocks).
    watermark_blocks: int = 0
    # Admit a waiting request only when its whole sequence fits the free blocks, not just its
    # first chunk (vLLM v1's `scheduler_reserve_full_isl`, on by default): without it a long
    # prompt is admitted chunk by chunk, the growing decodes preempt it half-prefilled (it is
    # the newest), it is readmitted, and the instance thrashes on its recompute for minutes.
    reserve_full_sequence: bool = True
    # Priority queue only: when the head of the waiting queue cannot be admitted, preempt
    # running requests of strictly lower priority until it can (vLLM V0's priority preemption).
    preempt_for_priority: bool = True
    # vLLM's automatic prefix caching (shared.engine_model.prefix_cache): requests that carry
    # block hashes reuse the cached full blocks of their prefix and skip that prefill. Off by
    # default so that results measured without it stay as they were.
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {QUEUE_POLICIES}, not {self.queue_policy!r}")
        if self.step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}, not {self.step_mode!r}")
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        unchunked_v1 = self.step_mode == "v1" and not self.enable_chunked_prefill
        if unchunked_v1 and self.max_num_batched_tokens < self.max_model_len:
            # As vLLM: without chunking a long prompt must fit the budget, or decodes starve it.
            raise ValueError("v1 without chunked prefill needs max_num_batched_tokens >= max_model_len")
        if not 0 <= self.watermark_blocks < self.num_blocks:
            raise ValueError("watermark_blocks must be in [0, num_blocks)")

    @property
    def max_seq_len(self) -> int:
        """Longest sequence that can ever run: generation stops (LENGTH) at this many tokens."""
        return min(self.max_model_len, self.num_blocks * self.block_size)
