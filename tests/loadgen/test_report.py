"""Result JSON field names (vllm bench serve's where the metric is the same) and `compare`."""

from __future__ import annotations

import json

import pytest

from loadgen.client import EndpointConfig
from loadgen.compare import comparable_metrics, format_comparison, load_result
from loadgen.errors import LoadgenError
from loadgen.metrics import compute_metrics
from loadgen.records import RequestRecord, RequestStatus
from loadgen.report import DETAIL_FIELDS, format_summary, result_to_json
from loadgen.runner import BenchmarkConfig, BenchmarkResult
from loadgen.schedule import SchedulePlan

VLLM_FIELDS = (
    "date endpoint_type backend label model_id tokenizer_id num_prompts request_rate burstiness "
    "max_concurrency duration completed failed total_input_tokens total_output_tokens request_throughput "
    "request_goodput output_throughput total_token_throughput max_output_tokens_per_s max_concurrent_requests"
).split()


def _result(percentiles=(50, 90, 99), priority_fraction=None) -> BenchmarkResult:
    records = [
        RequestRecord(0, 5, 4, -1, send_s=0.0, chunk_s=[0.1, 0.2], end_s=0.2, status=RequestStatus.OK,
                      text="ab"),
        RequestRecord(1, 5, 4, 0, send_s=0.1, chunk_s=[0.3, 0.4, 0.6], end_s=0.6, status=RequestStatus.OK),
        RequestRecord(2, 5, 4, 0, send_s=0.2, end_s=0.3, status=RequestStatus.REJECTED,
                      error="HTTP 429: busy"),
    ]
    config = BenchmarkConfig(
        endpoint=EndpointConfig("http://h", "m"),
        dataset="random:5:4",
        plan=SchedulePlan(arrival="poisson", rate=2.0, cv=2.0, priority_fraction=priority_fraction),
        percentiles=percentiles,
        goodput_ms={"ttft": 150},
    )
    metrics = compute_metrics(records, 1.0, percentiles, config.goodput_ms)
    return BenchmarkResult(config, records, metrics, "20250101-000000")


def test_json_has_vllm_field_names() -> None:
    data = result_to_json(_result(percentiles=(50, 99.9)))
    assert set(VLLM_FIELDS) <= set(data)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{metric}_ms" in data
    assert data["request_rate"] == 2.0 and data["burstiness"] == pytest.approx(0.25)
    assert data["backend"] == data["endpoint_type"] == "openai-chat"
    assert data["request_goodput"] == 1.0 and data["rejected"] == 1 and data["failed"] == 0
    assert data["mean_prefill_latency_ms"] == data["mean_ttft_ms"]
    assert data["errors_summary"] == {"HTTP 429: busy": 1}
    assert not set(DETAIL_FIELDS) & set(data)
    json.dumps(data)  # serializable as is


def test_detailed_json_adds_per_request_lists() -> None:
    data = result_to_json(_result(), detailed=True)
    assert set(DETAIL_FIELDS) <= set(data)
    assert data["output_lens"] == [2, 3, 0]
    assert data["itls"][1] == pytest.approx([0.1, 0.2])
    assert data["errors"] == ["", "", "HTTP 429: busy"]


def test_priority_breakdown_reported_apart() -> None:
    result = _result(priority_fraction=0.5)
    data = result_to_json(result)
    assert data["by_priority"]["high"]["completed"] == 1
    assert data["by_priority"]["normal"]["completed"] == 1
    assert "high priority" in format_summary(result)


def test_summary_table_reads_like_vllm() -> None:
    text = format_summary(_result())
    for label in ("Successful requests:", "Rejected requests (HTTP 429):", "Mean TTFT (ms):", "P99 ITL (ms):",
                  "Request goodput (req/s):", "Peak concurrent requests:"):
        assert label in text


def test_compare_prints_ratios(tmp_path, capsys) -> None:
    a = {"request_throughput": 2.0, "mean_ttft_ms": 100.0, "p99_ttft_ms": 300.0, "label": "x"}
    b = {"request_throughput": 3.0, "mean_ttft_ms": 50.0, "p99_ttft_ms": 0.0, "label": "y"}
    assert comparable_metrics(a, b) == ["request_throughput", "mean_ttft_ms", "p99_ttft_ms"]
    text = format_comparison(a, b, "a.json", "b.json")
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[4:]}
    assert rows["request_throughput"][-1] == "1.500"
    assert rows["mean_ttft_ms"][-1] == "0.500"
    assert rows["p99_ttft_ms"][-1] == "0.000"


def test_compare_refuses_a_bad_file(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(LoadgenError, match="not a JSON result"):
        load_result(bad)
    with pytest.raises(LoadgenError, match="cannot read"):
        load_result(tmp_path / "absent.json")
