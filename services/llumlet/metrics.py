"""A llumlet's Prometheus metrics: vLLM's names where the meaning is the same, `corral:` otherwise."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared.messages import LoadReport


class LlumletMetrics:
    def __init__(self, model_name: str, engine: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry
        self._labels = (model_name, engine)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions by recompute", labels, registry=r)
        self.freeness = Gauge("corral:llumlet_freeness", "Head-of-line freeness (Llumnix Algorithm 1)", labels, registry=r)
        self.dispatch_freeness = Gauge("corral:llumlet_dispatch_freeness",
                                       "Freeness counting the whole waiting queue", labels, registry=r)
        self.migrations = Counter("corral:llumlet_migrations", "Migrations by direction and outcome",
                                  [*labels, "direction", "outcome"], registry=r)
        self._preemptions_seen = 0

    def observe_report(self, report: LoadReport) -> None:
        labels = self._labels
        self.running.labels(*labels).set(report.num_running)
        self.waiting.labels(*labels).set(report.num_waiting)
        used = report.num_blocks_total - report.num_blocks_free
        self.kv_usage.labels(*labels).set(used / report.num_blocks_total if report.num_blocks_total else 0.0)
        self.freeness.labels(*labels).set(report.freeness)
        self.dispatch_freeness.labels(*labels).set(report.dispatch_freeness)
        if report.num_preemptions_total > self._preemptions_seen:
            self.preemptions.labels(*labels).inc(report.num_preemptions_total - self._preemptions_seen)
            self._preemptions_seen = report.num_preemptions_total

    def migration_done(self, direction: str, outcome: str) -> None:
        self.migrations.labels(*self._labels, direction, outcome).inc()
