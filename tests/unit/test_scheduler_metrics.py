"""The global scheduler's /metrics: its dispatch answers and the load table it decides from."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from services.global_scheduler.config import SchedulerConfig
from services.global_scheduler.service import GlobalScheduler
from shared.messages import DispatchRequest
from tests.unit.policy_helpers import make_load


def samples(scheduler: GlobalScheduler) -> dict[tuple[str, tuple], float]:
    text = generate_latest(scheduler.metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def fresh(load):
    load.sent_at = time.time()
    return load


def test_dispatch_answers_and_the_load_table_are_exported():
    scheduler = GlobalScheduler(SchedulerConfig(nats_url="nats://unused:4222"))
    scheduler.table.update(fresh(make_load("a", running={0: (2, 40)})))
    scheduler.table.update(fresh(make_load("b", running={0: (5, 90)})))
    for i in range(3):
        assert scheduler.decide(DispatchRequest(f"r{i}", 16, 16, 0, [])).instance_id is not None
    rejected = scheduler.decide(DispatchRequest("long", 10**6, 16, 0, []))
    assert rejected.rejected

    seen = samples(scheduler)
    assert seen[("corral:scheduler_dispatches_total", (("outcome", "dispatched"),))] == 3
    assert seen[("corral:scheduler_dispatches_total", (("outcome", "too_long"),))] == 1
    assert seen[("corral:scheduler_dispatches_total", (("outcome", "overloaded"),))] == 0  # there from the start
    assert seen[("corral:scheduler_dispatch_decision_seconds_count", ())] == 4
    assert seen[("corral:scheduler_live_instances", ())] == 2
    assert seen[("corral:scheduler_migration_pairs", ())] == 0
    assert seen[("corral:instance_requests_running", (("instance_id", "b"),))] == 5
    assert seen[("corral:instance_kv_blocks_free", (("instance_id", "b"),))] == 10
