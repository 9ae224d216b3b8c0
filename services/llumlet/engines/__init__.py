"""Build the engine a llumlet's config asks for."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the config imports the sim engine's settings from under this package)
    from services.llumlet.config import LlumletConfig
    from services.llumlet.engine import Engine


def model_vocabulary(model_dir: str | None) -> tuple[int, int | None, str]:
    """(vocab_size, eos_token_id, name) of a local model directory, so the simulated engine emits
    ids the gateway's tokenizer can decode. Without a model: LLaMA-7B's vocabulary."""
    if model_dir is None:
        return 32000, None, "sim-llama-7b"
    path = Path(model_dir)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--model {model_dir}: cannot read config.json ({exc})") from exc
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return int(config["vocab_size"]), eos, path.name


def create_engine(config: LlumletConfig) -> Engine:
    """The engine, or SystemExit with the reason when a setting is out of range."""
    try:
        return _create_engine(config)
    except ValueError as exc:
        raise SystemExit(f"bad {config.engine} engine settings: {exc}") from exc


def _create_engine(config: LlumletConfig) -> Engine:
    if config.engine == "sim":
        from services.llumlet.engines.sim.engine import SimEngine

        vocab_size, eos, name = model_vocabulary(config.model_dir)
        sim = config.sim
        scheduler = replace(sim.scheduler, max_model_len=config.max_model_len)
        return SimEngine(replace(sim, scheduler=scheduler, vocab_size=vocab_size, eos_token_id=eos, seed=config.seed,
                                 model_name=name))
    if config.engine == "vllm":
        if config.model_dir is None:
            raise SystemExit("--engine vllm needs --model DIR")
        from services.llumlet.engines.vllm.engine import VllmEngine, VllmEngineConfig

        return VllmEngine(
            VllmEngineConfig(
                model_dir=config.model_dir,
                max_model_len=config.max_model_len,
                kv_cache_space_gib=config.vllm.kv_cache_space_gib,
                max_num_seqs=config.vllm.max_num_seqs,
                cpu_threads=config.vllm.cpu_threads,
                enable_prefix_caching=config.vllm.prefix_caching,
                seed=config.seed,
            )
        )
    raise SystemExit(f"unknown engine {config.engine!r}")
