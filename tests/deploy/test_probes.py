"""What the Kubernetes probes ask: `/health` (liveness) and `/ready` (readiness) on a service's
metrics port, and when a llumlet counts as ready."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from services.llumlet.readiness import not_ready_reason
from shared.messages import LoadReport
from shared.metrics_server import serve_metrics


def report(sent_at: float) -> LoadReport:
    return LoadReport(instance_id="a", seq=1, sent_at=sent_at, num_blocks_total=10, num_blocks_free=10,
                      block_size=16, num_running=0, num_waiting=0, head_demand_blocks=0, waiting_demand_blocks=0,
                      num_preemptions_total=0)


def test_a_llumlet_is_ready_once_it_reports_and_not_while_draining_disconnected_or_silent():
    now = 1000.0
    assert not_ready_reason(report(now), False, True, 0.05, now) is None
    assert "no load report" in not_ready_reason(None, False, True, 0.05, now)
    assert not_ready_reason(report(now), True, True, 0.05, now) == "draining"
    assert "NATS" in not_ready_reason(report(now), False, False, 0.05, now)
    assert "ago" in not_ready_reason(report(now - 5), False, True, 0.05, now)


def test_metrics_port_serves_health_and_ready_with_the_reason():
    reason = ["starting"]
    server = serve_metrics(CollectorRegistry(), _free(), "127.0.0.1", ready=lambda: reason[0])
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert httpx.get(f"{base}/health").status_code == 200
        reply = httpx.get(f"{base}/ready")
        assert reply.status_code == 503 and reply.text.strip() == "starting"
        reason[0] = None
        assert httpx.get(f"{base}/ready").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.get(f"{base}/other").status_code == 404
    finally:
        server.close()


def test_without_a_readiness_check_there_is_no_ready_path():
    server = serve_metrics(CollectorRegistry(), _free(), "127.0.0.1")
    try:
        assert httpx.get(f"http://127.0.0.1:{server.port}/ready").status_code == 404
    finally:
        server.close()


def _free() -> int:
    from tests.support.cluster import free_port

    return free_port()


async def test_the_scheduler_is_ready_once_connected_to_nats(nats_url):
    from services.global_scheduler.config import SchedulerConfig
    from services.global_scheduler.service import GlobalScheduler

    scheduler = GlobalScheduler(SchedulerConfig(nats_url, enable_migration=False, metrics_port=_free()))
    assert scheduler.not_ready_reason() == "not connected to NATS"
    await scheduler.start()
    try:
        assert scheduler.not_ready_reason() is None
        reply = httpx.get(f"http://127.0.0.1:{scheduler.config.metrics_port}/ready")
        assert reply.status_code == 200
    finally:
        await scheduler.stop()
