"""Results out: the console summary (laid out like vllm bench serve's) and the JSON result file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.errors import LoadgenError
from loadgen.failures import failure_lines, group_failures
from loadgen.metrics import BenchmarkMetrics, Summary, compute_metrics
from loadgen.records import RequestRecord
from loadgen.runner import BenchmarkResult, describe_plan
from loadgen.schedule import HIGH_PRIORITY

DETAIL_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "prefill_latency": ("prefill latency", "Prefill latency (= TTFT)"),
    "decode_latency": ("decode latency", "Decode latency per output token"),
}
_WIDTH = 50


def percentile_key(p: float) -> str:
    """99 → '99', 99.9 → '99.9' (vllm keeps decimals in p99.9_ttft_ms)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def summary_fields(name: str, summary: Summary) -> dict[str, float]:
    fields = {
        f"mean_{name}_ms": summary.mean_ms,
        f"median_{name}_ms": summary.median_ms,
        f"std_{name}_ms": summary.std_ms,
    }
    for p, value in summary.percentiles_ms.items():
        fields[f"p{percentile_key(p)}_{name}_ms"] = value
    return fields


def metrics_fields(metrics: BenchmarkMetrics) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "rejected": metrics.rejected,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "peak_in_flight_requests": metrics.peak_in_flight_requests,
    }
    for name, summary in {**metrics.summaries(), **metrics.split_summaries()}.items():
        fields.update(summary_fields(name, summary))
    fields["errors_summary"] = metrics.errors
    fields["error_groups"] = [
        {"shape": g.shape, "count": g.count, "distinct_messages": g.distinct, "example": g.example}
        for g in group_failures(metrics.errors)
    ]
    return fields


def result_to_json(result: BenchmarkResult, detailed: bool = False) -> dict[str, Any]:
    config = result.config
    plan = describe_plan(config)
    backend = "openai-chat" if config.endpoint.api == "chat" else "openai"  # vllm's backend names
    out: dict[str, Any] = {
        "date": result.date,
        "endpoint_type": backend,
        "backend": backend,
        "label": config.label,
        "model_id": config.endpoint.model,
        "tokenizer_id": config.tokenizer,
        "num_prompts": len(result.records),
        "request_rate": plan.pop("request_rate"),
        "burstiness": plan.pop("burstiness"),
        "max_concurrency": plan.pop("max_concurrency"),
        "endpoint": config.endpoint.base_url,
        "dataset": config.dataset,
        "goodput_slo_ms": config.goodput_ms or None,
        "percentiles": list(config.percentiles),
        **plan,
    }
    out.update(metrics_fields(result.metrics))
    by_priority = priority_breakdown(result)
    if by_priority:
        out["by_priority"] = {name: metrics_fields(m) for name, m in by_priority.items()}
    if detailed:
        out.update(detail_fields(result.records))
    return out


def detail_fields(records: Sequence[RequestRecord]) -> dict[str, list]:
    """Per-request lists in vllm's names (times in seconds; start_times from the benchmark start)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft_s if r.ok else 0.0 for r in records],
        "itls": [r.itls_s if r.ok else [] for r in records],
        "latencies": [r.e2el_s if r.ok else 0.0 for r in records],
        "start_times": [r.send_s for r in records],
        "generated_texts": [r.text for r in records],
        "errors": [r.error or "" for r in records],
        "priorities": [r.priority for r in records],
        "statuses": [r.status.value for r in records],
    }


def priority_breakdown(result: BenchmarkResult) -> dict[str, BenchmarkMetrics]:
    """High and normal priority reported apart (BENCHMARKS.md), when priorities were sent."""
    if result.config.plan.priority_fraction is None:
        return {}
    config, records = result.config, result.records
    groups = {
        "high": [r for r in records if r.priority == HIGH_PRIORITY],
        "normal": [r for r in records if r.priority != HIGH_PRIORITY],
    }
    return {
        name: compute_metrics(group, result.metrics.duration_s, config.percentiles, config.goodput_ms or None)
        for name, group in groups.items()
        if group
    }


def write_result(path: str | Path, data: dict[str, Any]) -> None:
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise LoadgenError(f"cannot write result file {target}: {exc.strerror or exc}") from None


def format_summary(result: BenchmarkResult) -> str:
    metrics, config = result.metrics, result.config
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]
    lines += _counts(metrics, config.max_concurrency, config.plan.rate)
    for name, summary in metrics.summaries().items():
        lines += _summary_lines(name, summary)
    lines.append(" Llumnix split ".center(_WIDTH, "-"))
    for name, summary in metrics.split_summaries().items():
        lines += _mean_p99_lines(_HEADERS[name][0], summary)
    for name, group in priority_breakdown(result).items():
        lines.append(f" {name} priority ".center(_WIDTH, "-"))
        lines.append(_row("Successful requests:", group.completed))
        for metric in ("ttft", "tpot", "e2el"):
            lines += _mean_p99_lines(_HEADERS[metric][0], group.summaries()[metric])
    if metrics.errors:
        lines.append(" Errors ".center(_WIDTH, "-"))
        lines += failure_lines(metrics.errors)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _counts(metrics: BenchmarkMetrics, max_concurrency: int | None, rate: float) -> list[str]:
    rows = [
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
        _row("Rejected requests (HTTP 429):", metrics.rejected),
    ]
    if max_concurrency is not None:
        rows.append(_row("Maximum request concurrency:", max_concurrency))
    if rate != float("inf"):
        rows.append(_row("Request rate configured (RPS):", rate))
    rows += [
        _row("Benchmark duration (s):", metrics.duration_s),
        _row("Total input tokens:", metrics.total_input_tokens),
        _row("Total generated tokens:", metrics.total_output_tokens),
        _row("Request throughput (req/s):", metrics.request_throughput),
    ]
    if metrics.request_goodput is not None:
        rows.append(_row("Request goodput (req/s):", metrics.request_goodput))
    rows += [
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
        _row("Peak concurrent requests:", metrics.max_concurrent_requests),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    return rows


def _summary_lines(name: str, summary: Summary) -> list[str]:
    short, header = _HEADERS[name]
    lines = [header.center(_WIDTH, "-")]
    lines.append(_row(f"Mean {short} (ms):", summary.mean_ms))
    lines.append(_row(f"Median {short} (ms):", summary.median_ms))
    lines.append(_row(f"Std {short} (ms):", summary.std_ms))
    for p, value in summary.percentiles_ms.items():
        lines.append(_row(f"P{percentile_key(p)} {short} (ms):", value))
    return lines


def _mean_p99_lines(short: str, summary: Summary) -> list[str]:
    """Mean and P99 (or the highest chosen percentile when 99 was not chosen)."""
    top = 99.0 if 99.0 in summary.percentiles_ms else max(summary.percentiles_ms)
    return [
        _row(f"Mean {short} (ms):", summary.mean_ms),
        _row(f"P{percentile_key(top)} {short} (ms):", summary.percentiles_ms[top]),
    ]


def _row(label: str, value: float | int) -> str:
    shown = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
    return f"{label:<40} {shown}"
