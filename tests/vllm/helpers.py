"""Constants and helpers shared by the vLLM tests (imported by conftest and the test modules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.llumlet.engines.vllm.engine import VllmEngineConfig

# The tiny model holds 1 KiB of KV per token (2 layers x 2 KV heads x 32 dims x K,V x 4 bytes).
KV_BYTES_PER_TOKEN = 1024
BLOCK_SIZE = 32
NUM_BLOCKS = 24  # vLLM keeps one as its null block: 23 usable, 736 tokens
MAX_MODEL_LEN = 512
RESULT_PREFIX = "REFERENCE-TOKEN-IDS "  # llm_reference.py's result line, among vLLM's logs


def small_engine_config_for(model_dir: Path) -> VllmEngineConfig:
    """A KV cache of a few hundred tokens: a handful of long requests force preemptions."""
    return VllmEngineConfig(
        model_dir=str(model_dir),
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        kv_cache_space_gib=NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN / (1 << 30),
        max_num_seqs=16,
        seed=0,
    )


@dataclass
class ReferenceRun:
    """`vllm.LLM.generate` running in a subprocess; `result()` waits for its token ids."""

    process: subprocess.Popen
    log: Any  # its stdout and stderr: a file, so it never blocks on a pipe

    def result(self, timeout_s: float = 240) -> list[list[int]]:
        self.process.wait(timeout=timeout_s)
        self.log.seek(0)
        output = self.log.read()
        assert self.process.returncode == 0, f"reference run failed:\n{output[-4000:]}"
        lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
        assert len(lines) == 1, f"no result line in the reference run's output:\n{output[-4000:]}"
        return json.loads(lines[0].removeprefix(RESULT_PREFIX))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def start_reference_run(config: VllmEngineConfig, prompts: list[list[int]], sampling: dict) -> ReferenceRun:
    request = {
        "engine": dict(
            model=config.model_dir,
            dtype="float32",
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            kv_cache_memory_bytes=int(config.kv_cache_space_gib * (1 << 30)),
            max_num_seqs=config.max_num_seqs,
            enforce_eager=True,
            seed=config.seed,
        ),
        "prompts": prompts,
        "sampling": sampling,
    }
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    script = Path(__file__).with_name("llm_reference.py")
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [sys.executable, str(script), json.dumps(request)], stdout=log, stderr=log, text=True, env=env
    )
    return ReferenceRun(process, log)
