"""The prefix-heavy workloads of the cache-aware benchmarks (prefix_dispatch, migration_prefix,
admission): one home, so the dispatch and the migration sweeps run the same requests.

- `conversation`: conversation:long (loadgen/conversation.py): seeded sessions, each turn
  re-sending the conversation so far; the sessions' timestamps rescaled to the rate.
- `system-prompts`: the same sessions, each opening with one of a few long shared system prompts,
  Zipf-skewed so one dominates (where cache affinity piles).
- `mooncake`: the Mooncake-format trace slice in the handouts, its 400 requests once (a cycled
  trace repeats its own prompts and inflates hits), in the trace's order. Seed 0 replays the
  trace's own timestamps rescaled to the rate; every other seed draws fresh Poisson gaps at the
  rate (the process the synthetic trace's arrivals came from), so seeds are different runs:
  the replay alone would make every seed the same run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from loadgen.datasets import PREFIX_BLOCK_TOKENS
from loadgen.simulator.workload import Workload, WorkloadSpec, build_workload

# The handouts beside the checkout (../shared), as the tests find them.
MOONCAKE = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_synthetic_first400.jsonl")
MOONCAKE_REQUESTS = 400
WORKLOADS = ("conversation", "system-prompts", "mooncake")


def mooncake_workload(rate: float, seed: int, max_seq_len: int) -> Workload:
    replay = seed == 0
    spec = WorkloadSpec(f"mooncake:{MOONCAKE}", num_requests=MOONCAKE_REQUESTS, rate=rate,
                        trace_timestamps=replay, seed=seed)
    return build_workload(spec, max_seq_len)


def prefix_workload(name: str, rate: float, seed: int, max_seq_len: int, *, conversation_requests: int,
                    system_prompts: int, system_prompt_tokens: int) -> Workload:
    """Raises ValueError for a name outside WORKLOADS."""
    if name == "mooncake":
        return mooncake_workload(rate, seed, max_seq_len)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: {', '.join(WORKLOADS)}")
    spec = WorkloadSpec("conversation:long", num_requests=conversation_requests, rate=rate,
                        trace_timestamps=True, seed=seed)
    workload = build_workload(spec, max_seq_len)
    if name == "system-prompts":
        workload = with_system_prompts(workload, system_prompts, system_prompt_tokens, max_seq_len, seed)
    return workload


def with_system_prompts(workload: Workload, num_prompts: int, prompt_tokens: int, max_seq_len: int,
                        seed: int) -> Workload:
    """Each session (named by its first hash id) opens with one of `num_prompts` shared system
    prompts, drawn with a seeded Zipf-like skew; prompts cut to leave room for their output."""
    rng = np.random.default_rng([seed, 18])
    blocks = -(-prompt_tokens // PREFIX_BLOCK_TOKENS)
    first_free = 1 + max((i for a in workload.arrivals for i in a.hash_ids), default=0)
    system_ids = [tuple(range(first_free + k * blocks, first_free + (k + 1) * blocks)) for k in range(num_prompts)]
    weights = 1.0 / np.arange(1, num_prompts + 1)
    weights /= weights.sum()
    chosen: dict[int, int] = {}
    arrivals = []
    for a in workload.arrivals:
        session = a.hash_ids[0] if a.hash_ids else -a.index - 1
        k = chosen.setdefault(session, int(rng.choice(num_prompts, p=weights)))
        prompt = min(blocks * PREFIX_BLOCK_TOKENS + a.prompt_len, max_seq_len - a.output_len)
        arrivals.append(replace(a, prompt_len=prompt, hash_ids=system_ids[k] + a.hash_ids))
    return Workload(arrivals, f"{workload.description} + {num_prompts} system prompts of {prompt_tokens}")
