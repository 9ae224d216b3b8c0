"""The global scheduler's Prometheus metrics: its decisions, and the load table as it sees it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.messages import LoadReport, Refusal

DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
# The answers `choose_instance` gives, each counted from zero: an instance, or one of its refusals.
DISPATCH_OUTCOMES = ("dispatched", Refusal.TOO_LONG.value, Refusal.NO_INSTANCE.value, Refusal.OVERLOADED.value)


class SchedulerMetrics:
    def __init__(self, live_loads: Callable[[], Sequence[LoadReport]], standing_pairs: Callable[[], int]) -> None:
        self.registry = r = CollectorRegistry()
        self.dispatches = Counter("corral:scheduler_dispatches", "Dispatch answers by outcome (dispatched, or the "
                                  "refusal: too_long, no_instance, overloaded)", ["outcome"], registry=r)
        for outcome in DISPATCH_OUTCOMES:
            self.dispatches.labels(outcome)
        self.decision_seconds = Histogram("corral:scheduler_dispatch_decision_seconds",
                                          "Time to choose an instance (policy only, no messaging)",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.migration_orders = Counter("corral:scheduler_migration_orders", "Migrate orders sent, by kind",
                                        ["kind"], registry=r)
        r.register(_LoadTableCollector(live_loads, standing_pairs))

    def dispatched(self, refusal: Refusal | None) -> None:
        self.dispatches.labels("dispatched" if refusal is None else refusal.value).inc()

    def order_sent(self, cancel: bool) -> None:
        self.migration_orders.labels("cancel" if cancel else "pair").inc()


class _LoadTableCollector(Collector):
    """Read at scrape time, so the numbers are the table's, not a copy that may lag it."""

    def __init__(self, live_loads: Callable[[], Sequence[LoadReport]], standing_pairs: Callable[[], int]) -> None:
        self.live_loads = live_loads
        self.standing_pairs = standing_pairs

    def collect(self) -> Iterator[GaugeMetricFamily]:
        loads = self.live_loads()
        yield GaugeMetricFamily("corral:scheduler_live_instances", "Instances with a fresh load report",
                                value=len(loads))
        yield GaugeMetricFamily("corral:scheduler_migration_pairs", "Standing migration pairs",
                                value=self.standing_pairs())
        per_instance = {
            "corral:instance_freeness": ("Head-of-line freeness (Llumnix Algorithm 1)", lambda l: l.freeness),
            "corral:instance_dispatch_freeness": ("Freeness counting the whole waiting queue",
                                                  lambda l: l.dispatch_freeness),
            "corral:instance_requests_running": ("Requests in the running batch", lambda l: l.num_running),
            "corral:instance_requests_waiting": ("Requests waiting", lambda l: l.num_waiting),
            "corral:instance_kv_blocks_free": ("Free KV blocks", lambda l: l.num_blocks_free),
        }
        for name, (doc, value_of) in per_instance.items():
            family = GaugeMetricFamily(name, doc, labels=["instance_id"])
            for load in loads:
                family.add_metric([load.instance_id], value_of(load))
            yield family
