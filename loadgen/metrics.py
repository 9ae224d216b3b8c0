"""Benchmark metrics exactly as BENCHMARKS.md (and `vllm bench serve`) define them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from loadgen.records import RequestRecord, RequestStatus

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Summary:
    """mean / median / std / percentiles of one latency, in milliseconds (0 when empty, as vllm)."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]
    count: int

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> Summary:
        values = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
        return cls(
            mean_ms=float(np.mean(values)),
            median_ms=float(np.median(values)),
            std_ms=float(np.std(values)),
            percentiles_ms={p: float(np.percentile(values, p)) for p in percentiles},
            count=len(values_s),
        )


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int  # errors other than rejections
    rejected: int  # HTTP 429
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    peak_in_flight_requests: int
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary
    prefill: Summary  # Llumnix's split: prefill latency = TTFT
    decode: Summary  # mean time per output token after the first, per request
    errors: dict[str, int] = field(default_factory=dict)

    def summaries(self) -> dict[str, Summary]:
        return {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl, "e2el": self.e2el}

    def split_summaries(self) -> dict[str, Summary]:
        return {"prefill_latency": self.prefill, "decode_latency": self.decode}


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] → {'ttft': 500.0, 'tpot': 50.0} (milliseconds). Raises ValueError."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            names = ", ".join(GOODPUT_METRICS)
            raise ValueError(f"bad goodput SLO {item!r}: expected NAME:MS with NAME among {names}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not slos[name] > 0:
            raise ValueError(f"bad goodput SLO {item!r}: must be > 0 ms")
    return slos


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    assert duration_s > 0, duration_s
    done = [r for r in records if r.ok]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    peak_tokens, peak_concurrent = _per_second_peaks(done)
    ttft = Summary.of([r.ttft_s for r in done], percentiles)
    tpot = Summary.of(tpots, percentiles)
    return BenchmarkMetrics(
        completed=len(done),
        failed=sum(r.status is RequestStatus.FAILED for r in records),
        rejected=sum(r.status is RequestStatus.REJECTED for r in records),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        request_goodput=_goodput(done, goodput_ms) / duration_s if goodput_ms else None,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrent,
        peak_in_flight_requests=peak_in_flight(records),
        ttft=ttft,
        tpot=tpot,
        itl=Summary.of([gap for r in done for gap in r.itls_s], percentiles),
        e2el=Summary.of([r.e2el_s for r in done], percentiles),
        prefill=ttft,
        decode=tpot,
        errors=dict(Counter(r.error or "unknown error" for r in records if not r.ok).most_common()),
    )


def _goodput(done: Sequence[RequestRecord], slos_ms: dict[str, float]) -> int:
    """Requests meeting every SLO (≤); a single-token output counts as TPOT 0, as vllm does."""
    def values_s(record: RequestRecord) -> dict[str, float]:
        return {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}

    return sum(
        all(values_s(r)[name] <= limit / 1000.0 for name, limit in slos_ms.items()) for r in done
    )


def _per_second_peaks(done: Sequence[RequestRecord]) -> tuple[float, int]:
    """vllm's peaks: content chunks per one-second bucket, and requests active in each bucket."""
    if not done:
        return 0.0, 0
    first = min(r.send_s for r in done)
    last = max(r.chunk_s[-1] for r in done)
    buckets = int(math.ceil(last - first)) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets)
    for record in done:
        for chunk in record.chunk_s:
            bucket = int(chunk - first)
            if 0 <= bucket < buckets:
                tokens[bucket] += 1
        start_bucket = int(record.send_s - first)
        end_bucket = int(record.chunk_s[-1] - first)
        active[start_bucket : end_bucket + 1] += 1
    return float(tokens.max()), int(active.max())


def peak_in_flight(records: Sequence[RequestRecord]) -> int:
    """The most requests open at one instant (send → end), all outcomes included."""
    events = sorted([(r.send_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    peak = current = 0
    for _, step in events:  # ends sort before sends at equal times: touching is not overlapping
        current += step
        peak = max(peak, current)
    return peak
