"""The cache-aware benchmarks' workloads (benchmarks/prefix_workloads.py): the Mooncake slice's
seeds are different runs of the same requests, and a workload the benchmarks do not know is
refused, not run as another."""

from __future__ import annotations

import pytest

from benchmarks import migration_prefix, prefix_dispatch
from benchmarks.prefix_workloads import MOONCAKE_REQUESTS, mooncake_workload, prefix_workload
from tests.simulator.helpers import trace_path

MAX_SEQ_LEN = 8192
RATE = 8.0


@pytest.fixture(autouse=True)
def _trace_present():
    trace_path("mooncake_synthetic_first400.jsonl")  # skips, saying why, where the handouts are absent


def test_each_mooncake_seed_is_its_own_arrivals_of_the_same_requests_in_the_same_order():
    runs = {seed: mooncake_workload(RATE, seed, MAX_SEQ_LEN) for seed in (0, 1, 2)}
    requests = {seed: [(a.prompt_len, a.output_len, a.hash_ids) for a in w.arrivals] for seed, w in runs.items()}
    times = {seed: [a.time_s for a in w.arrivals] for seed, w in runs.items()}
    assert len(requests[0]) == MOONCAKE_REQUESTS
    assert requests[0] == requests[1] == requests[2]
    assert times[0] != times[1] and times[1] != times[2] and times[0] != times[2]
    for seed, stamps in times.items():
        assert stamps == sorted(stamps)
        assert MOONCAKE_REQUESTS / stamps[-1] == pytest.approx(RATE, rel=0.2), seed
    # The same seed is the same run.
    assert [a.time_s for a in mooncake_workload(RATE, 1, MAX_SEQ_LEN).arrivals] == times[1]


def test_seed_zero_replays_the_trace_timestamps():
    replay = mooncake_workload(RATE, 0, MAX_SEQ_LEN)
    gaps = [b.time_s - a.time_s for a, b in zip(replay.arrivals, replay.arrivals[1:])]
    assert "trace timestamps" in replay.description
    # The trace's own gaps, rescaled so that its requests span exactly their number over the rate.
    assert replay.arrivals[-1].time_s == pytest.approx(MOONCAKE_REQUESTS / RATE)
    assert min(gaps) >= 0
    assert "Poisson" in mooncake_workload(RATE, 3, MAX_SEQ_LEN).description


def test_an_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        prefix_workload("moncake", RATE, 0, MAX_SEQ_LEN, conversation_requests=10, system_prompts=2,
                        system_prompt_tokens=512)


@pytest.mark.parametrize("main", [prefix_dispatch.main, migration_prefix.main])
def test_the_benchmarks_refuse_an_unknown_workload_with_a_usage_error(main, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--workloads", "conversation,moncake"])
    assert exit_info.value.code == 2
    assert "unknown workload(s) moncake" in capsys.readouterr().err
