"""Prometheus metrics of one gateway, in vLLM's naming style (`corral:` prefix, seconds, `_total`).

Each gateway owns its registry, so several can live in one process (tests) without clashing.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (vllm/v1/metrics/buckets.py), so dashboards built for vLLM read ours too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# llm-d's scheduler buckets: dispatch decisions take well under a second.
DISPATCH_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        r = self.registry
        self.requests = Counter("corral:gateway_requests", "Requests by endpoint and final HTTP status "
                                "(mid-stream errors count with their error code; 499: client went away)",
                                ["model_name", "endpoint", "status"], registry=r)
        self.ttft = Histogram("corral:gateway_time_to_first_token_seconds", "Time from request arrival to "
                              "the first output token", ["model_name"], buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("corral:gateway_e2e_request_latency_seconds", "Time from request arrival to its "
                             "last token", ["model_name"], buckets=E2E_BUCKETS, registry=r)
        self.dispatch_latency = Histogram("corral:gateway_dispatch_duration_seconds", "Time to choose an instance "
                                          "(scheduler round trip or bypass)", buckets=DISPATCH_BUCKETS, registry=r)
        self.bypass_dispatches = Counter("corral:gateway_bypass_dispatches", "Requests dispatched by the gateway "
                                         "itself because the global scheduler did not answer", registry=r)
        self.in_flight = Gauge("corral:gateway_requests_in_flight", "Requests dispatched and not finished",
                               ["model_name"], registry=r)
        self.instances_alive = Gauge("corral:gateway_instances_alive", "Instances whose load reports are recent",
                                     registry=r)
        self.prompt_tokens = Counter("corral:gateway_prompt_tokens", "Prompt tokens of dispatched requests",
                                     ["model_name"], registry=r)
        self.generation_tokens = Counter("corral:gateway_generation_tokens",
                                         "Output tokens received for clients (up to a stop string)",
                                         ["model_name"], registry=r)

    def watch_instances(self, count: Callable[[], int]) -> None:
        self.instances_alive.set_function(count)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(self._model, endpoint, str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self._model).observe(seconds)

    def finished(self, seconds: float) -> None:
        self.e2e.labels(self._model).observe(seconds)

    def generation_tokens_sent(self, num_tokens: int) -> None:
        self.generation_tokens.labels(self._model).inc(num_tokens)

    def in_flight_changed(self, delta: int) -> None:
        self.in_flight.labels(self._model).inc(delta)

    def prompt_tokens_sent(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self._model).inc(num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
