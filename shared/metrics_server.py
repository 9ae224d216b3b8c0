"""Serve a Prometheus registry on `/metrics` for services that have no HTTP server of their own."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
    """Port 0 keeps metrics off (several llumlets on one host would otherwise collide)."""
    if port <= 0:
        return
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
