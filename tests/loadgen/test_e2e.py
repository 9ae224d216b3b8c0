"""`loadgen run` end to end against the in-test OpenAI-compatible streaming server."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from loadgen.cli import main
from loadgen.client import EndpointConfig
from loadgen.errors import LoadgenError
from loadgen.records import RequestStatus
from loadgen.runner import BenchmarkConfig, run_benchmark
from loadgen.schedule import SchedulePlan

from .fake_server import FakeBehaviour, FakeServer


def _config(url: str, tokenizer_dir, **overrides) -> BenchmarkConfig:
    fields = dict(
        endpoint=EndpointConfig(url, "fake-model"),
        dataset="random:16:3",
        plan=SchedulePlan(arrival="poisson", rate=200.0, seed=1),
        tokenizer=str(tokenizer_dir),
        num_requests=12,
    )
    fields.update(overrides)
    return BenchmarkConfig(**fields)


async def test_run_records_chunks_usage_and_rejections(tokenizer_dir) -> None:
    behaviour = FakeBehaviour(chunks=5, reject_every=4)
    async with FakeServer(behaviour) as server:
        result = await run_benchmark(_config(server.url, tokenizer_dir))
    by_index = {r.index: r for r in result.records}
    assert [i for i, r in by_index.items() if r.status is RequestStatus.REJECTED] == [0, 4, 8]
    assert result.metrics.rejected == 3 and result.metrics.failed == 0 and result.metrics.completed == 9
    done = by_index[1]
    assert len(done.chunk_s) == 3 and done.completion_tokens == 3 and done.prompt_tokens == 7
    assert done.text == "t0 t1 t2 " and done.input_len == 16
    assert result.metrics.total_output_tokens == 27
    assert all(body["max_tokens"] == 3 and body["stream"] for body in behaviour.bodies)
    assert all(len(body["messages"][0]["content"].split()) > 0 for body in behaviour.bodies)
    assert "HTTP 429: too many requests" in result.metrics.errors


async def test_mid_stream_error_event_is_a_failure(tokenizer_dir) -> None:
    async with FakeServer(FakeBehaviour(chunks=4, error_every=3)) as server:
        result = await run_benchmark(_config(server.url, tokenizer_dir, num_requests=6))
    failed = sorted(r.index for r in result.records if r.status is RequestStatus.FAILED)
    assert failed == [1, 4]
    assert result.metrics.errors == {"engine died": 2}


async def test_concurrency_cap_priority_and_ignore_eos(tokenizer_dir) -> None:
    behaviour = FakeBehaviour(chunks=3, gap_s=0.01)
    config = _config(
        "http://placeholder",
        tokenizer_dir,
        plan=SchedulePlan(arrival="burst", seed=2, priority_fraction=0.5, max_tokens=2),
        max_concurrency=2,
        num_requests=8,
    )
    async with FakeServer(behaviour) as server:
        endpoint = EndpointConfig(server.url, "fake-model", api="completions", ignore_eos=True)
        result = await run_benchmark(replace(config, endpoint=endpoint))
    assert result.metrics.completed == 8
    assert result.metrics.peak_in_flight_requests <= 2
    assert sorted(body["priority"] for body in behaviour.bodies) == [-1] * 4 + [0] * 4
    assert all(body["ignore_eos"] is True and body["max_tokens"] == 2 for body in behaviour.bodies)
    assert all(isinstance(body["prompt"], str) for body in behaviour.bodies)


async def test_unreachable_endpoint_is_a_loadgen_error(tokenizer_dir) -> None:
    async with FakeServer(FakeBehaviour()) as server:
        url = server.url
    with pytest.raises(LoadgenError, match="cannot reach endpoint"):
        await run_benchmark(_config(url, tokenizer_dir, num_requests=1))


async def test_cli_writes_result_detail_and_plots(tokenizer_dir, tmp_path, capsys) -> None:
    result_file, plot_dir = tmp_path / "out" / "result.json", tmp_path / "plots"
    async with FakeServer(FakeBehaviour(chunks=3, reject_every=5)) as server:
        argv = ["run", "--endpoint", server.url + "/v1", "--model", "fake-model", "--dataset", "random:8:3",
                "--tokenizer", str(tokenizer_dir), "--num-requests", "10", "--request-rate", "100",
                "--goodput", "ttft:5000", "--percentiles", "50,99.9", "--result-file", str(result_file),
                "--save-detailed", "--plot", str(plot_dir), "--no-progress", "--label", "e2e"]
        code = await asyncio.to_thread(main, argv)
    assert code == 0
    data = json.loads(result_file.read_text())
    assert (data["completed"], data["rejected"], data["label"]) == (8, 2, "e2e")
    assert "p99.9_ttft_ms" in data and len(data["ttfts"]) == 10 and data["request_goodput"] > 0
    assert {p.name for p in plot_dir.iterdir()} == {"latency_cdf.png", "timeline.png"}
    assert "Serving Benchmark Result" in capsys.readouterr().out


async def test_duration_stops_a_closed_loop_early(tokenizer_dir) -> None:
    plan = SchedulePlan(arrival="burst")
    config = _config("", tokenizer_dir, plan=plan, max_concurrency=1, num_requests=200, duration_s=0.2)
    async with FakeServer(FakeBehaviour(chunks=3, gap_s=0.02)) as server:
        result = await run_benchmark(replace(config, endpoint=EndpointConfig(server.url, "fake-model")))
    assert 1 <= len(result.records) < 200  # each request takes >= 60 ms, one at a time
    # The last send is decided before 0.2 s; its task records send_s a moment later (a loaded
    # machine: a few ms). A send decided after the deadline would come a whole request (60 ms) late.
    assert all(r.send_s < 0.2 + 0.05 for r in result.records)


async def test_trace_timestamps_are_replayed(tokenizer_dir) -> None:
    from .conftest import trace_path

    dataset = f"burstgpt:{trace_path('BurstGPT_1.csv')}"
    plan = SchedulePlan(arrival="trace", time_scale=1e-4, max_tokens=2)  # 4,720 s of trace in 0.47 s
    config = _config("", tokenizer_dir, dataset=dataset, plan=plan, num_requests=10)
    async with FakeServer(FakeBehaviour(chunks=2)) as server:
        result = await run_benchmark(replace(config, endpoint=EndpointConfig(server.url, "fake-model")))
    trace_s = [0, 40, 113, 180]  # the fixture's first timestamps (5, 45, 118, 185) from the first
    sends = sorted(r.send_s for r in result.records)
    assert all(sent >= t * 1e-4 for sent, t in zip(sends, trace_s))
    assert result.records[0].input_len == 472 and result.metrics.completed == 10
