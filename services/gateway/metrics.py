"""Prometheus metrics of one gateway: what the client sees, under vLLM's names, and Corral's own.

The gateway measures what vLLM's frontend measures, as the client sees it: time to first token
and inter-token latency as they happen (`engine` = the instance holding the request); time per
output token, e2e latency, decode time, how each request finished, its prompt/output lengths,
its max_tokens and the prompt tokens computed (not cached) when it ends (`engine` = the instance
that finished it); `n` and the longest of its n outputs once per client request, as vLLM's
parallel sampling records them (`engine` = the instance that finished the longest). Engine-side
series (queue, prefill and inference time, running/waiting, KV usage, token counters, tokens per
step) come from the llumlets; Corral's own (`corral:gateway_*`) sit beside them.
Each gateway owns its registry, so several can live in one process (tests) without clashing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared import vllm_metrics as vllm
from shared.metrics_server import CONTENT_TYPE, render

if TYPE_CHECKING:
    from services.gateway.generation import Generation
    from services.gateway.prepared import PreparedRequest

__all__ = ["CONTENT_TYPE", "GatewayMetrics", "RequestTimeline", "timeline_of"]

# llm-d's scheduler buckets: dispatch decisions take well under a second.
DISPATCH_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
# A migration's stall is a decode step or a few (milliseconds to ~100 ms); seconds mean trouble.
MIGRATION_STALL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# Admission's TTFT prediction against the TTFT measured here: tens of ms (the bus, the step
# boundary) when it holds; seconds when the instance was busier than its report said.
TTFT_PREDICTION_ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class RequestTimeline:
    """One dispatched request as the gateway saw it (monotonic seconds)."""

    engine: str  # the instance that held it last (after any migration)
    arrival: float
    ended: float
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens_param: int | None  # what the client asked for, if it did
    finished_reason: str  # one of vllm.FINISHED_REASONS
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_cached_tokens: int | None = None  # of the prompt, in the first instance's prefix cache


def timeline_of(generation: Generation, prepared: PreparedRequest, engine: str) -> RequestTimeline:
    """How a request ended, in vLLM's finish reasons: an error is "error", a client that left
    before the end is "abort"."""
    if generation.finish_reason is not None:
        reason = generation.finish_reason
    else:
        reason = "error" if generation.error is not None else "abort"
    return RequestTimeline(
        engine=engine, arrival=prepared.arrival, ended=time.monotonic(),
        num_prompt_tokens=len(prepared.prompt_token_ids), num_output_tokens=generation.num_output_tokens,
        max_tokens_param=prepared.options.max_tokens, finished_reason=reason,
        first_token_at=generation.first_token_at, last_token_at=generation.last_token_at,
        num_cached_tokens=generation.stream.num_cached_tokens,
    )


class GatewayMetrics:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = r = CollectorRegistry()
        self._model = model_name
        self._engines_seen: set[str] = set()
        labels = vllm.LABELS
        tokens = vllm.request_tokens_buckets(max_model_len)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=vllm.TIME_TO_FIRST_TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=vllm.INTER_TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", labels,
                              buckets=vllm.INTER_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=vllm.REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", labels,
                                     buckets=vllm.REQUEST_LATENCY_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=r)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                                    buckets=tokens, registry=r)
        self.output_len = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                    labels, buckets=tokens, registry=r)
        # (vLLM's help text says "requested", but it records the most tokens any of the n outputs got.)
        self.max_generation_tokens = Histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", labels,
                                               buckets=tokens, registry=r)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                  buckets=vllm.REQUEST_PARAMS_N_BUCKETS, registry=r)
        self.max_tokens_param = Histogram("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", labels,
                                          buckets=tokens, registry=r)
        self.prefill_computed = Histogram("vllm:request_prefill_kv_computed_tokens",
                                          "Histogram of new KV tokens computed during prefill (excluding cached "
                                          "tokens).", labels, buckets=tokens, registry=r)
        self.requests = Counter("corral:gateway_requests", "Requests by endpoint and final HTTP status "
                                "(mid-stream errors count with their error code; 499: client went away)",
                                ["model_name", "endpoint", "status"], registry=r)
        self.rejections = Counter("corral:gateway_rejections", "Requests refused before any output, by typed "
                                  "reason (shared.messages.Refusal; 'error' when the gateway failed otherwise)",
                                  ["model_name", "endpoint", "reason"], registry=r)
        self.dispatch_latency = Histogram("corral:gateway_dispatch_duration_seconds", "Time to choose an instance "
                                          "(scheduler round trip or bypass)", buckets=DISPATCH_BUCKETS, registry=r)
        self.migration_stall = Histogram("corral:gateway_migration_stall_seconds", "Gap in a request's token "
                                         "stream at a migration: the last new token from the instance it left to "
                                         "the first from the one it moved to", ["model_name"],
                                         buckets=MIGRATION_STALL_BUCKETS, registry=r)
        self.migration_stall.labels(model_name)
        self.ttft_prediction_error = Histogram(
            "corral:gateway_ttft_prediction_error_seconds", "How far each admitted request's time to first token "
            "strayed from admission control's prediction on its instance (the scheduler's, with --admission): "
            "'late' when it came after the predicted time, 'early' when before", ["model_name", "direction"],
            buckets=TTFT_PREDICTION_ERROR_BUCKETS, registry=r)
        for direction in ("late", "early"):
            self.ttft_prediction_error.labels(model_name, direction)
        self.bypass_dispatches = Counter("corral:gateway_bypass_dispatches", "Requests dispatched by the gateway "
                                         "itself because the global scheduler did not answer", registry=r)
        self.in_flight = Gauge("corral:gateway_requests_in_flight", "Requests dispatched and not finished",
                               ["model_name"], registry=r)
        self.in_flight.labels(model_name)
        self.instances_alive = Gauge("corral:gateway_instances_alive", "Instances whose load reports are recent",
                                     registry=r)
        self._live_ids: Callable[[], Sequence[str]] = list

    def watch_instances(self, live_ids: Callable[[], Sequence[str]]) -> None:
        """Read at scrape time: the live count, and every engine's counters present at zero."""
        self._live_ids = live_ids
        self.instances_alive.set_function(lambda: len(live_ids()))

    def engine_seen(self, engine: str) -> None:
        """A new engine's series start at zero, as vLLM's do: every histogram, and one counter per
        finish reason."""
        if engine in self._engines_seen:
            return
        self._engines_seen.add(engine)
        for reason in vllm.FINISHED_REASONS:
            self.success.labels(self._model, engine, reason)
        for histogram in (self.ttft, self.itl, self.tpot, self.e2e, self.decode_time, self.prompt_len,
                          self.output_len, self.max_generation_tokens, self.params_n, self.max_tokens_param,
                          self.prefill_computed):
            histogram.labels(self._model, engine)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(self._model, endpoint, str(status)).inc()

    def request_rejected(self, endpoint: str, reason: str) -> None:
        self.rejections.labels(self._model, endpoint, reason).inc()

    def request_finished(self, t: RequestTimeline) -> None:
        """A dispatched request ended (finished, failed or abandoned by its client)."""
        labels = (self._model, t.engine)
        self.engine_seen(t.engine)
        self.success.labels(*labels, t.finished_reason).inc()
        self.e2e.labels(*labels).observe(t.ended - t.arrival)
        self.prompt_len.labels(*labels).observe(t.num_prompt_tokens)
        self.output_len.labels(*labels).observe(t.num_output_tokens)
        self.prefill_computed.labels(*labels).observe(t.num_prompt_tokens - (t.num_cached_tokens or 0))
        if t.max_tokens_param is not None:
            self.max_tokens_param.labels(*labels).observe(t.max_tokens_param)
        if t.first_token_at is None or t.last_token_at is None:
            return
        decode = t.last_token_at - t.first_token_at
        self.decode_time.labels(*labels).observe(decode)
        # As vLLM: the first token is prefill's; a one-token request counts 0.
        self.tpot.labels(*labels).observe(decode / (t.num_output_tokens - 1) if t.num_output_tokens > 1 else 0.0)

    def choices_finished(self, n: int, outputs: Sequence[tuple[str, int]]) -> None:
        """A client request's `n` choices ended (each counted by `request_finished`); `outputs`:
        (engine, output tokens) of those that reached an instance. Its n, and its longest output."""
        if not outputs:
            return
        engine, longest = max(outputs, key=lambda output: output[1])
        self.engine_seen(engine)
        self.params_n.labels(self._model, engine).observe(n)
        self.max_generation_tokens.labels(self._model, engine).observe(longest)

    def first_token(self, engine: str, ttft_s: float) -> None:
        """As it happens (`TokenTimes`), labelled with the instance holding the request then."""
        self.engine_seen(engine)
        self.ttft.labels(self._model, engine).observe(ttft_s)

    def next_tokens(self, engine: str, gap_s: float) -> None:
        """The gap since the previous delivery of tokens: vLLM's inter-token latency (one per step)."""
        self.itl.labels(self._model, engine).observe(gap_s)

    def ttft_predicted(self, predicted_s: float, measured_s: float) -> None:
        """(`TokenTimes`) A request's first token, against the TTFT admission predicted for it."""
        error = measured_s - predicted_s
        self.ttft_prediction_error.labels(self._model, "late" if error > 0 else "early").observe(abs(error))

    def migration_stalled(self, seconds: float) -> None:
        self.migration_stall.labels(self._model).observe(seconds)

    def in_flight_changed(self, delta: int) -> None:
        self.in_flight.labels(self._model).inc(delta)

    def render(self) -> bytes:
        for engine in self._live_ids():
            self.engine_seen(engine)
        return render(self.registry)
