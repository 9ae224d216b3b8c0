"""Building vLLM's `LLMEngine` from a `VllmEngineConfig`: in process, with Corral's settings.

Sets the process environment vLLM reads at start-up, then builds the engine from `engine_kwargs`
(prefix hashing as the gateway's chain, KV events, the KV connector). Imports vLLM: call on the
engine thread (`VllmDriver.build`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from services.llumlet.engines.vllm.config import VllmEngineConfig
from services.llumlet.engines.vllm.kv_events import HASH_ALGO, RAW_DIGESTS_ENV, kv_events_config

log = logging.getLogger(__name__)

GIB = 1 << 30


def build_llm_engine(config: VllmEngineConfig, served_model_name: str) -> Any:
    """A new in-process vLLM v1 `LLMEngine` (seconds to tens of seconds)."""
    # In process: no spawned engine-core process (so no `__main__` guard needed), and the
    # scheduler is reachable for load views.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.kv_cache_space_gib is not None and os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None):
        # On CPU this legacy variable (whole GiB only) would override kv_cache_memory_bytes.
        log.warning("ignoring VLLM_CPU_KVCACHE_SPACE: the engine config sets the KV cache size")
    if config.enable_prefix_caching:
        os.environ.update(RAW_DIGESTS_ENV)  # KV events with whole digests (`prefix_pins.py`)
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    if not torch.cuda.is_available():
        torch.set_num_threads(config.cpu_threads)  # before vLLM's start-up disables the setter
    return LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(config, served_model_name)))


def engine_kwargs(config: VllmEngineConfig, served_model_name: str) -> dict[str, Any]:
    """vLLM EngineArgs for the config (imports vLLM: call on the engine thread)."""
    from vllm.platforms import current_platform

    kwargs: dict[str, Any] = dict(
        model=config.model_dir,
        served_model_name=served_model_name,
        dtype=config.dtype or ("float32" if current_platform.is_cpu() else "auto"),
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=config.enforce_eager,
        seed=config.seed,
        enable_prefix_caching=config.enable_prefix_caching,
        # The gateway's chain (shared.prefix_hash), and vLLM's block events into the llumlet's journal.
        prefix_caching_hash_algo=HASH_ALGO,
        kv_events_config=kv_events_config() if config.enable_prefix_caching else None,
        scheduling_policy=config.scheduling_policy,
        # One step in, that step's tokens out, so outputs and snapshots describe the same moment.
        # (The CPU build never schedules asynchronously; on a GPU this gives up some overlap.)
        async_scheduling=False,
        disable_log_stats=True,
    )
    if config.kv_cache_space_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_space_gib * GIB)
    if config.block_size is not None:
        kwargs["block_size"] = config.block_size
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.kv_connector:
        from services.llumlet.engines.vllm.connector import kv_transfer_config

        kwargs["kv_transfer_config"] = kv_transfer_config()
    return kwargs
