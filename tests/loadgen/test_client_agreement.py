"""benchmarks/client_agreement.py's pure parts: reading each client's result in vLLM's names, the
gateway's histograms, and the ratios it reports."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_clients import read_aiperf
from benchmarks.client_agreement import (
    _histogram_total,
    compared_keys,
    median_over_rounds,
    ratios,
    rotated,
    server_means,
)

EXPOSITION = """# HELP vllm:time_to_first_token_seconds TTFT
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{model_name="m",engine="a"} 1.5
vllm:time_to_first_token_seconds_count{model_name="m",engine="a"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="m",engine="b"} 0.5
vllm:time_to_first_token_seconds_count{model_name="m",engine="b"} 10.0
corral:gateway_e2e_request_latency_seconds_sum 4.0
corral:gateway_e2e_request_latency_seconds_count 2.0
"""


def test_histogram_totals_sum_label_sets_and_keep_colons() -> None:
    assert _histogram_total(EXPOSITION, "vllm:time_to_first_token_seconds") == (2.0, 20.0)
    assert _histogram_total(EXPOSITION, "corral:gateway_e2e_request_latency_seconds") == (4.0, 2.0)
    assert _histogram_total(EXPOSITION, "vllm:e2e_request_latency_seconds") is None


def test_server_means_cover_only_the_requests_between_scrapes() -> None:
    before = {"ttft": (1.0, 10.0)}
    after = {"ttft": (4.0, 20.0), "e2el": (8.0, 4.0)}
    assert server_means(before, after) == {"server_mean_ttft_ms": pytest.approx(300.0),
                                           "server_mean_e2el_ms": pytest.approx(2000.0)}


def test_aiperf_export_maps_to_vllm_names(tmp_path) -> None:
    export = {
        "time_to_first_token": {"unit": "ms", "avg": 120.0, "p50": 110.0, "p99": 300.0},
        "inter_token_latency": {"unit": "ms", "avg": 40.0, "p50": 41.0, "p99": 45.0},  # per request: TPOT
        "inter_chunk_latency": {"unit": "ns", "avg": 6.0e7, "p50": 4.5e7, "p99": 3.0e8},  # pooled: ITL
        "request_latency": {"unit": "s", "avg": 2.5, "p50": 2.4, "p99": 3.0},
        "request_throughput": {"unit": "requests/sec", "avg": 7.5},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 480.0},
        "request_count": {"unit": "requests", "avg": 100.0},
    }
    target = tmp_path / "aiperf" / "run"
    target.mkdir(parents=True)
    (target / "profile_export_aiperf.json").write_text(json.dumps(export))
    figures = read_aiperf(tmp_path)
    assert figures["median_ttft_ms"] == 110.0 and figures["mean_tpot_ms"] == 40.0
    assert figures["p99_itl_ms"] == pytest.approx(300.0) and figures["mean_e2el_ms"] == pytest.approx(2500.0)
    assert figures["output_throughput"] == 480.0 and figures["completed"] == 100.0
    assert "total_token_throughput" not in figures


def test_ratios_are_to_loadgen_for_shared_figures_only() -> None:
    results = {
        "vllm_bench": {"mean_ttft_ms": 90.0, "failed": 0.0, "only_vllm": 1.0},
        "loadgen": {"mean_ttft_ms": 100.0, "failed": 0.0, "mean_tpot_ms": 40.0},
        "aiperf": {"mean_ttft_ms": 110.0},
    }
    assert compared_keys(results) == ["mean_ttft_ms", "failed"]
    assert ratios(results) == {
        "vllm_bench": {"mean_ttft_ms": pytest.approx(0.9), "failed": None},
        "aiperf": {"mean_ttft_ms": pytest.approx(1.1)},
    }


def test_rounds_rotate_the_order_and_combine_by_median() -> None:
    clients = ["vllm_bench", "loadgen", "aiperf"]
    assert rotated(clients, 1) == ["loadgen", "aiperf", "vllm_bench"]
    assert rotated(clients, 3) == clients
    rounds = [{"loadgen": {"x": 1.0}}, {"loadgen": {"x": 5.0}}, {"loadgen": {"x": 2.0, "y": 3.0}}]
    assert median_over_rounds(rounds) == {"loadgen": {"x": 2.0, "y": 3.0}}
