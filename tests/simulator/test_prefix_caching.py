"""Prefix caching in `loadgen simulate`: trace hash_ids become block-hash chains, instances reuse
cached prefixes, and the prefix-aware dispatch finds them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.simulator.cluster import ClusterSimulator
from loadgen.simulator.config import SimConfig
from loadgen.simulator.workload import SimArrival, Workload
from shared.engine_model.config import SchedulerConfig
from shared.policy.baselines import get_policy
from tests.simulator.helpers import simulate, synthetic

CACHING = SimConfig(num_instances=4, scheduler=SchedulerConfig(num_blocks=2048, max_model_len=16384,
                                                               enable_prefix_caching=True))


def hit_rate(result) -> float:
    return sum(r.num_cached_tokens for r in result.finished) / sum(r.prompt_len for r in result.finished)


def test_repeated_trace_prefix_hits_on_one_instance():
    # Three requests sharing two 512-token trace blocks, far apart in time, on one instance.
    rows = [SimArrival(i, 5.0 * i, 1100, 4, 0, hash_ids=(7, 8, 100 + i)) for i in range(3)]
    config = replace(CACHING, num_instances=1)
    result = simulate(config, "corral", Workload(rows, "hand-made"))
    cached = sorted(r.num_cached_tokens for r in result.finished)
    assert cached == [0, 1024, 1024]
    off = simulate(replace(config, scheduler=replace(config.scheduler, enable_prefix_caching=False)), "corral",
                   Workload(rows, "hand-made"))
    ttft = {r.request_id: r.first_token_time - r.arrival_time for r in result.finished}
    ttft_off = {r.request_id: r.first_token_time - r.arrival_time for r in off.finished}
    assert ttft["r1"] < 0.5 * ttft_off["r1"] and ttft["r0"] == ttft_off["r0"]


def test_prefix_aware_dispatch_finds_the_conversations_prefixes():
    workload = synthetic("conversation:long", 120, 2.0, CACHING, trace_timestamps=True)
    results = {p: simulate(CACHING, p, workload) for p in ("corral", "corral-prefix", "prefix-only")}
    assert all(len(r.finished) == 120 for r in results.values())
    assert hit_rate(results["corral-prefix"]) > 2 * hit_rate(results["corral"])
    assert hit_rate(results["corral-prefix"]) > 0.8 * hit_rate(results["prefix-only"])


def test_a_mixed_fleet_leaves_every_nth_instances_waiting_prefill_untold():
    # Every other instance reports as an engine without token counts would; the rest tell theirs.
    config = replace(CACHING, untold_every=2)
    assert [config.tells_prefill_tokens(i) for i in range(4)] == [False, True, False, True]
    sim = ClusterSimulator(config, get_policy("corral-prefix"),
                           synthetic("conversation:long", 40, 2.0, config, trace_timestamps=True))
    result = sim.run()
    assert len(result.finished) == 40
    told = {i.instance_id: i.report.waiting_prefill_tokens is not None for i in sim.instances.values()}
    assert told == {"i000": False, "i001": True, "i002": False, "i003": True}
    with pytest.raises(ValueError):
        replace(CACHING, untold_every=-1)
