"""Engine step times for Llama-2-7B (fp16, TP 1), from the fitted profiles in LATENCY_MODEL.md.

The scheduler's output already carries the aggregates these formulas need (prefill tokens,
prefill chunk sizes with their prior context, decode batch size and total decode context), so a
step costs O(number of prefill chunks) here, not O(batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class StepShape(Protocol):
    """What a step looks like to the latency model (`SchedulerOutput` has these fields)."""

    prefill_tokens: int
    prefill_chunks: list[tuple[int, int]]
    decode_batch_size: int
    decode_context_tokens: int


@dataclass(frozen=True)
class SimpleCoefficients:
    """prefill(n) = a·n + b; decode(bs, tot) = c + d·bs + e·tot (milliseconds)."""

    prefill_ms_per_token: float
    prefill_fixed_ms: float
    decode_fixed_ms: float
    decode_ms_per_seq: float
    decode_ms_per_context_token: float


SIMPLE_MODELS: dict[str, SimpleCoefficients] = {
    "A10": SimpleCoefficients(0.255, 8.2, 28.2, 0.100, 1.12e-3),
    "A100": SimpleCoefficients(0.0765, 0.3, 8.8, 0.030, 0.339e-3),
    "H100": SimpleCoefficients(0.0230, 3.7, 5.6, 0.0114, 0.209e-3),
}

# Finer A10 form (operator-level): linear layers on all N tokens of the step, prefill attention
# per chunk, decode attention over the total decode context, and a small per-step constant.
_A10_PREFILL_ATTN_MS_PER_TOKEN = 0.0122
_A10_PREFILL_ATTN_MS_PER_PAIR = 1.6e-5  # times c², i.e. c queries × c/2 keys on average
_A10_DECODE_ATTN_MS_PER_TOKEN = 0.97e-3
_A10_DECODE_ATTN_BATCH_FACTOR = 1.1
_A10_STEP_OVERHEAD_MS = 1.0  # LM head and sampling ("δ ≈ 1–2")


class LatencyModel:
    def __init__(self, gpu: str = "A10", fine: bool = False) -> None:
        if gpu not in SIMPLE_MODELS:
            raise ValueError(f"unknown GPU {gpu!r}; expected one of {sorted(SIMPLE_MODELS)}")
        if fine and gpu != "A10":
            raise ValueError("the fine latency form exists only for the A10 profile")
        self.gpu = gpu
        self.fine = fine
        self._simple = SIMPLE_MODELS[gpu]

    def prefill_ms(self, num_tokens: int) -> float:
        c = self._simple
        return c.prefill_ms_per_token * num_tokens + c.prefill_fixed_ms

    def decode_ms(self, batch_size: int, context_tokens: int) -> float:
        c = self._simple
        return c.decode_fixed_ms + c.decode_ms_per_seq * batch_size + c.decode_ms_per_context_token * context_tokens

    def step_time_of(self, step: StepShape) -> float:
        """Seconds for a step described by the scheduler's output."""
        return self.step_time_s(
            step.prefill_tokens, step.prefill_chunks, step.decode_batch_size, step.decode_context_tokens
        )

    def step_time_s(
        self,
        prefill_tokens: int,
        prefill_chunks: Sequence[tuple[int, int]],
        decode_batch_size: int,
        decode_context_tokens: int,
    ) -> float:
        """Seconds for one engine step.

        prefill_chunks: (chunk_tokens, context_before) per prefilling request (only the fine
        form reads it); decode_context_tokens: context attended by all decoding requests.
        """
        if self.fine:
            ms = self._fine_ms(prefill_tokens, prefill_chunks, decode_batch_size, decode_context_tokens)
        else:
            ms = self._simple_ms(prefill_tokens, decode_batch_size, decode_context_tokens)
        return ms * 1e-3

    def _simple_ms(self, prefill_tokens: int, decode_batch_size: int, decode_context_tokens: int) -> float:
        if decode_batch_size == 0:
            return self.prefill_ms(prefill_tokens) if prefill_tokens else 0.0
        decode = self.decode_ms(decode_batch_size, decode_context_tokens)
        if prefill_tokens == 0:
            return decode
        # A mixed (v1) step runs the model once: the per-step fixed cost that both fits include
        # in their intercepts (launches, weight reads, sampling) is paid once, so the smaller
        # intercept is taken off the sum. Decode-only and prefill-only steps match the fits.
        c = self._simple
        return self.prefill_ms(prefill_tokens) + decode - min(c.prefill_fixed_ms, c.decode_fixed_ms)

    @staticmethod
    def _fine_ms(
        prefill_tokens: int,
        prefill_chunks: Sequence[tuple[int, int]],
        decode_batch_size: int,
        decode_context_tokens: int,
    ) -> float:
        n = prefill_tokens + decode_batch_size
        if n == 0:
            return 0.0
        ms = max(28.4 + 0.106 * n, 17.6 + 0.210 * n) + _A10_STEP_OVERHEAD_MS
        for chunk, context_before in prefill_chunks:
            # A_pf(c) = 0.0122·c + 1.6e-5·c² for a fresh prompt; a later chunk's queries also
            # attend the `context_before` tokens already in the cache: c·(c + 2·before) pairs.
            ms += _A10_PREFILL_ATTN_MS_PER_TOKEN * chunk
            ms += _A10_PREFILL_ATTN_MS_PER_PAIR * chunk * (chunk + 2 * context_before)
        if decode_batch_size:
            attn = _A10_DECODE_ATTN_MS_PER_TOKEN * decode_context_tokens
            ms += attn * _A10_DECODE_ATTN_BATCH_FACTOR if decode_batch_size > 1 else attn
        return ms
