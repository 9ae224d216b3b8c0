"""What one prefix-aware dispatch decision costs, with the global prefix index, by fleet size.

    .venv/bin/python -m benchmarks.prefix_dispatch_cost [--instances 16,1000] [--decisions 2000]
        [--prompt-blocks 512] [--room-wait-weight 1] [--out results/prefix_dispatch_cost.json]

Each instance's index entry holds a random share of 20 shared system-prompt chains (plus its
own blocks, 851 in all: an A10's KV cache); each decision is one request of `--prompt-blocks`
blocks extending a random system prompt, through `choose_by_predicted_ttft` (the scan), through
the scheduler's `PrefixDispatchIndex` (the same answer, asserted: it predicts the holders and the
shortest queues only) and, for scale, freeness-only `choose_instance`, on load reports of every
instance. Prints the mean and P99
decision time; CPU time on a shared machine is noisy, compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from shared.config import non_negative_or_inf
from shared.messages import DispatchRequest, KvCacheEvents
from shared.policy.config import PolicyConfig
from shared.policy.dispatch import choose_instance
from shared.policy.prefix_dispatch import DEFAULT_ROOM_WAIT_WEIGHT, PrefixContext, choose_by_predicted_ttft
from shared.policy.prefix_dispatch_index import PrefixDispatchIndex
from shared.prefix_index import GlobalPrefixIndex
from tests.unit.policy_helpers import make_load

BLOCK = 16


def run(num_instances: int, decisions: int, prompt_blocks: int, room_wait_weight: float = DEFAULT_ROOM_WAIT_WEIGHT,
        seed: int = 0) -> dict:
    rng = random.Random(seed)
    systems = [[rng.getrandbits(63) for _ in range(prompt_blocks)] for _ in range(20)]
    index = GlobalPrefixIndex()
    loads = []
    for k in range(num_instances):
        iid = f"i{k:04d}"
        held: list[int] = []
        for chain in rng.sample(systems, 3):
            held += chain[: rng.randrange(prompt_blocks // 2, prompt_blocks)]
        held += [rng.getrandbits(63) for _ in range(max(0, 851 - len(held)))]
        index.apply(KvCacheEvents(iid, 1, BLOCK, held[:851]))
        used = rng.randrange(0, 700)
        loads.append(make_load(iid, total=851, max_model_len=16384, running={0: (rng.randrange(1, 30), used)},
                               waiting=[rng.randrange(1, 60) for _ in range(rng.randrange(0, 4))]))
    context = PrefixContext(index, lambda tokens: tokens * 1e-4, room_wait_weight=room_wait_weight)
    config = PolicyConfig(headroom_blocks={})
    indexed = PrefixDispatchIndex(config, context)
    for load in loads:
        indexed.put(load)
    timings: dict[str, list[float]] = {"predicted-ttft": [], "predicted-ttft-index": [], "freeness-only": []}
    for i in range(decisions):
        chain = rng.choice(systems)[: rng.randrange(prompt_blocks // 2, prompt_blocks)]
        request = DispatchRequest(f"r{i}", len(chain) * BLOCK + 7, 64, block_hashes=chain, prefix_block_size=BLOCK)
        t0 = time.perf_counter()
        decision = choose_by_predicted_ttft(loads, request, config, context)
        t1 = time.perf_counter()
        baseline = choose_instance(loads, request, config)
        t2 = time.perf_counter()
        from_index = indexed.choose(request)
        t3 = time.perf_counter()
        assert decision.instance_id is not None and baseline.instance_id is not None, (decision, baseline)
        assert from_index == decision, (from_index, decision)
        timings["predicted-ttft"].append(t1 - t0)
        timings["freeness-only"].append(t2 - t1)
        timings["predicted-ttft-index"].append(t3 - t2)
    return {"instances": num_instances, "prompt_blocks": prompt_blocks, **{
        name: {"mean_ms": float(np.mean(v)) * 1e3, "p99_ms": float(np.percentile(v, 99)) * 1e3}
        for name, v in timings.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", default="16,1000")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--prompt-blocks", type=int, default=512)
    parser.add_argument("--room-wait-weight", type=non_negative_or_inf, default=DEFAULT_ROOM_WAIT_WEIGHT,
                        help="corral-prefix's charge for the blocks an instance lacks (inf: rooms first)")
    parser.add_argument("--out", default="results/prefix_dispatch_cost.json")
    args = parser.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.instances.split(",")):
        row = run(n, args.decisions, args.prompt_blocks, args.room_wait_weight)
        rows.append(row)
        print(f"{n:5d} instances: predicted-ttft mean {row['predicted-ttft']['mean_ms']:.3f} ms "
              f"P99 {row['predicted-ttft']['p99_ms']:.3f} ms | its index mean "
              f"{row['predicted-ttft-index']['mean_ms']:.3f} ms P99 {row['predicted-ttft-index']['p99_ms']:.3f} ms | "
              f"freeness-only mean "
              f"{row['freeness-only']['mean_ms']:.3f} ms P99 {row['freeness-only']['p99_ms']:.3f} ms", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: "inf" if v == float("inf") else v for k, v in vars(args).items()}  # (strict JSON)
    out.write_text(json.dumps({"args": settings, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
