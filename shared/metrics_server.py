"""Prometheus exposition for every service: always the classic text format, so `vllm:` names keep
their colons.

Why not `prometheus_client.start_http_server`: it negotiates the format from the scraper's Accept
header, and a Prometheus server asks for OpenMetrics first. prometheus_client's OpenMetrics writer
(0.22 to at least 0.26) escapes *sample* names with the label-name character set, which has no
colon: `# TYPE vllm:num_requests_running` is followed by `vllm_num_requests_running{...}`, and
Prometheus stores the underscore name. The text format (0.0.4) writes names as they are, and every
Prometheus version accepts it, so we serve that whatever is asked for (as the gateway always did).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

log = logging.getLogger(__name__)

# Why a service should take no traffic now, in words; None when it is ready (the `/ready` probe).
Readiness = Callable[[], "str | None"]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the text format 0.0.4, names untouched."""
    return generate_latest(registry)


class MetricsServer:
    """`/metrics` on a port of its own, served from a daemon thread; with it `/health` (the process
    answers: liveness) and, given a readiness check, `/ready` (200, or 503 with the reason)."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0",
                 ready: Readiness | None = None) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler_for(registry, ready))
        self._server.daemon_threads = True
        self.host = host
        self.port = self._server.server_address[1]  # the bound one, when asked for port 0
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"metrics:{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0",
                  ready: Readiness | None = None) -> MetricsServer | None:
    """A port ≤ 0 keeps metrics off (the default: several llumlets on one host would collide)."""
    if port <= 0:
        return None
    server = MetricsServer(registry, port, host, ready)
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server


def _handler_for(registry: CollectorRegistry, ready: Readiness | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self._answer(200, b"ok\n", "text/plain")
                return
            if path == "/ready" and ready is not None:
                reason = ready()
                self._answer(503 if reason else 200, f"{reason or 'ready'}\n".encode(), "text/plain")
                return
            if path not in ("/metrics", "/"):
                self.send_error(404, "only /metrics, /health and /ready are served here")
                return
            self._answer(200, render(registry), CONTENT_TYPE)

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # a scrape every few seconds is not news
            pass

    return Handler
