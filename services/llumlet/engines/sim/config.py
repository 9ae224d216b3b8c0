"""Settings of the simulated engine: the shared local scheduler's (`SchedulerConfig`, with its
defaults) plus what only the engine has (latency profile, time scale, fake KV bytes, tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine_model.config import SchedulerConfig


@dataclass(frozen=True)
class SimEngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gpu: str = "A10"  # "A10" | "A100" | "H100"
    fine_latency: bool = False  # the operator-level A10 form
    time_scale: float = 1.0  # real seconds slept per simulated second (0.01: 100x faster)
    kv_bytes_per_token: int = 64  # bytes of fake KV per token (multiple of 8); 0: no KV bytes at all
    vocab_size: int = 32000
    eos_token_id: int | None = None
    seed: int = 0
    model_name: str = "sim-llama-7b"

    def __post_init__(self) -> None:
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("eos_token_id must be inside the vocabulary")
        if self.kv_bytes_per_token < 0 or self.kv_bytes_per_token % 8:
            raise ValueError("kv_bytes_per_token must be 0 or a positive multiple of 8")
