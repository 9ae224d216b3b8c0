"""`loadgen run` as an async function: prepare the requests, send them on schedule, measure."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from loadgen.client import EndpointConfig, check_endpoint, make_client, send_request
from loadgen.datasets import DatasetSpec, check_dataset_readable, load_dataset, parse_dataset_spec
from loadgen.errors import LoadgenError
from loadgen.metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, compute_metrics
from loadgen.progress import DEFAULT_INTERVAL_S, Progress, ProgressMode, note
from loadgen.records import RequestRecord, RequestStatus
from loadgen.schedule import SchedulePlan, ScheduledRequest, build_schedule
from loadgen.synth import PromptSynthesizer, load_tokenizer

_MIN_CONNECTIONS = 1024


@dataclass(frozen=True)
class BenchmarkConfig:
    endpoint: EndpointConfig
    dataset: str
    plan: SchedulePlan = SchedulePlan()
    tokenizer: str | None = None  # local HF tokenizer directory
    num_requests: int | None = None
    duration_s: float | None = None  # stop sending new requests after this long
    max_concurrency: int | None = None
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    goodput_ms: dict[str, float] = field(default_factory=dict)
    label: str | None = None
    progress: ProgressMode = "off"  # "bar" on a terminal, "lines" in logs (loadgen.progress)
    progress_interval_s: float = DEFAULT_INTERVAL_S


@dataclass
class BenchmarkResult:
    config: BenchmarkConfig
    records: list[RequestRecord]
    metrics: BenchmarkMetrics
    date: str
    served_models: list[str] = field(default_factory=list)


async def run_benchmark(config: BenchmarkConfig) -> BenchmarkResult:
    """Load the dataset, synthesize prompts, check the endpoint, replay, and compute metrics."""
    check_dataset_readable(parse_dataset_spec(config.dataset))
    connections = max(_MIN_CONNECTIONS, config.max_concurrency or 0)
    async with make_client(config.endpoint, connections) as client:
        served = await check_endpoint(client, config.endpoint)  # before the slow preparation
        requests = await asyncio.to_thread(prepare_requests, config)
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        records, duration_s = await _replay(client, config, requests)
    if not records:
        raise LoadgenError("no request was sent (is --duration shorter than the first arrival?)")
    metrics = compute_metrics(records, duration_s, config.percentiles, config.goodput_ms or None)
    return BenchmarkResult(config, records, metrics, date, served)


def prepare_requests(config: BenchmarkConfig) -> list[ScheduledRequest]:
    """The requests to send, with their prompts: tens of seconds for thousands of long prompts,
    so each step says what it does and prompt synthesis reports its progress."""
    spec = parse_dataset_spec(config.dataset)
    tokenizer = None
    if config.tokenizer:
        note(config.progress, f"loading tokenizer {config.tokenizer}")
        tokenizer = load_tokenizer(config.tokenizer)
    note(config.progress, f"reading dataset {config.dataset}")
    specs = load_dataset(
        spec, num_requests=_request_count(config, spec), seed=config.plan.seed, tokenizer=tokenizer
    )
    synthesizer = None
    if tokenizer is not None:
        note(config.progress, "choosing prompt words from the tokenizer's vocabulary")
        synthesizer = PromptSynthesizer(tokenizer, config.plan.seed)
    progress = Progress("preparing prompts", len(specs), config.progress, unit="prompt",
                        interval_s=config.progress_interval_s)
    try:
        return build_schedule(specs, config.plan, synthesizer, on_prompt=progress.advance)
    finally:
        progress.close()


def _request_count(config: BenchmarkConfig, spec: DatasetSpec) -> int | None:
    """--num-requests; else enough for --duration at the request rate; else the dataset's own."""
    if config.num_requests is not None:
        return config.num_requests
    rate = config.plan.rate
    if config.duration_s is not None and config.plan.arrival in ("poisson", "gamma") and math.isfinite(rate):
        return math.ceil(rate * config.duration_s * 1.5) + 16
    return None


async def _replay(
    client: httpx.AsyncClient, config: BenchmarkConfig, requests: Sequence[ScheduledRequest]
) -> tuple[list[RequestRecord], float]:
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = Progress("sending", len(requests), config.progress, interval_s=config.progress_interval_s)
    ticker = asyncio.create_task(_tick(progress, config.progress_interval_s))
    tasks: list[asyncio.Task[RequestRecord]] = []
    clock_zero = time.perf_counter()

    async def send(request: ScheduledRequest) -> RequestRecord:
        record = None
        try:
            record = await send_request(client, config.endpoint, request, clock_zero)
            return record
        finally:
            if limit is not None:
                limit.release()
            status = record.status if record is not None else None
            progress.advance(failed=int(status is RequestStatus.FAILED),
                             rejected=int(status is RequestStatus.REJECTED))

    try:
        for request in requests:
            if config.duration_s is not None and request.arrival_s > config.duration_s:
                break
            await _sleep_until(clock_zero + request.arrival_s)
            if limit is not None:
                await limit.acquire()
            if config.duration_s is not None and time.perf_counter() - clock_zero > config.duration_s:
                if limit is not None:
                    limit.release()
                break
            tasks.append(asyncio.create_task(send(request)))
        records = list(await asyncio.gather(*tasks))
    finally:
        ticker.cancel()
        for task in tasks:
            task.cancel()
        progress.close()
    return records, time.perf_counter() - clock_zero


async def _tick(progress: Progress, interval_s: float) -> None:
    """Periodic lines while no request finishes (long generations)."""
    while True:
        await asyncio.sleep(interval_s)
        progress.tick()


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def describe_plan(config: BenchmarkConfig) -> dict[str, Any]:
    """Traffic settings for the result file, in vllm's field names where they exist."""
    plan = config.plan
    return {
        "request_rate": plan.rate if math.isfinite(plan.rate) else "inf",
        "burstiness": 1.0 / plan.cv**2,  # vllm's Gamma shape
        "max_concurrency": config.max_concurrency,
        "arrival": plan.arrival,
        "cv": plan.cv,
        "time_scale": plan.time_scale if plan.arrival == "trace" else None,
        "seed": plan.seed,
        "priority_fraction": plan.priority_fraction,
        "max_tokens_policy": "trace" if plan.max_tokens is None else plan.max_tokens,
        "ignore_eos": config.endpoint.ignore_eos,
        "duration_limit_s": config.duration_s,
    }


def run_title(config: BenchmarkConfig) -> str:
    """The run's name on plots: --label, else what was sent where at which rate."""
    if config.label:
        return config.label
    plan = config.plan
    pace = f"{plan.rate:g} req/s" if math.isfinite(plan.rate) else "all at once"
    return f"{config.endpoint.model}, {config.dataset}, {pace}"
