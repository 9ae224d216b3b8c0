"""The vLLM engine's settings (imports nothing of vLLM)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmEngineConfig:
    model_dir: str
    model_name: str | None = None  # default: the model directory's name
    dtype: str | None = None  # None: float32 on CPU, vLLM's choice ("auto") elsewhere
    max_model_len: int = 2048
    # KV cache size; None leaves it to vLLM (VLLM_CPU_KVCACHE_SPACE, or the GPU memory fraction).
    kv_cache_space_gib: float | None = 1.0
    block_size: int | None = None  # None: vLLM's default (128 on CPU, 16 on a GPU)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    enforce_eager: bool = True
    seed: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority": lower value first, as Corral's priorities
    # Torch (OpenMP) threads for the model on a CPU host. vLLM's own server runs its worker with
    # OMP_NUM_THREADS=1; in process, vLLM's later "reduce to 1 thread" call is a no-op, and a
    # second busy OpenMP thread took a whole core from the llumlet (0.4x vLLM's throughput).
    cpu_threads: int = 1
    # Corral's KV connector (`connector.py`): what live migration needs inside vLLM.
    kv_connector: bool = True

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.kv_cache_space_gib is not None and self.kv_cache_space_gib <= 0:
            raise ValueError(f"kv_cache_space_gib must be positive, got {self.kv_cache_space_gib}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
