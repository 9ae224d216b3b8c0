"""OpenTelemetry tracing: one setup per process, W3C trace context carried across NATS.

Off unless configured, with OpenTelemetry's own environment variables where they exist:

- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): export over OTLP, to
  Jaeger or a collector; `OTEL_EXPORTER_OTLP_PROTOCOL` is `http/protobuf` (the default, port 4318)
  or `grpc` (port 4317).
- `CORRAL_TRACE_FILE=PATH`: append every finished span to PATH as one JSON object per line (for
  tests and quick looks; several processes may share the file).
- `OTEL_SDK_DISABLED=true` turns both off. `OTEL_SERVICE_NAME` overrides the service name.

When off, OpenTelemetry's API hands out non-recording spans: the hooks in the services cost a
function call and no trace context travels (`inject` returns None, so NATS messages carry no headers).

Across NATS the context goes in message headers (`traceparent`, `tracestate`), as Dynamo does; there
is no official instrumentation for nats-py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "CORRAL_TRACE_FILE"
_configured = False


def tracing_configured() -> bool:
    """Whether the environment asks for spans to be exported."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(_otlp_endpoint() or os.environ.get(TRACE_FILE_ENV))


def _otlp_endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def enabled() -> bool:
    """Whether this process records spans (`setup_tracing` installed a provider)."""
    return _configured


def setup_tracing(service_name: str, instance_id: str | None = None) -> bool:
    """Install a tracer provider for this process when the environment asks for one; True if so.

    Call once, early in a service's start-up; later calls are no-ops."""
    global _configured
    if _configured or not tracing_configured():
        return _configured
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes))
    if _otlp_endpoint():
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    if path := os.environ.get(TRACE_FILE_ENV):
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    trace.set_tracer_provider(provider)
    _configured = True
    log.info("tracing on for %s (otlp=%s, file=%s)", attributes["service.name"], _otlp_endpoint(),
             os.environ.get(TRACE_FILE_ENV))
    return True


def _otlp_exporter():
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if (protocol or "http/protobuf").strip() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()  # endpoint, headers and timeouts from the OTEL_* variables


def shutdown_tracing() -> None:
    """Flush spans still in the batch (a service's orderly exit)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(context: Context | None = None) -> dict[str, str] | None:
    """W3C trace-context headers for an outgoing message; None when there is nothing to carry."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier or None


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The remote context in a message's headers (None when it carries none: start a new trace)."""
    if not carrier or "traceparent" not in carrier:
        return None
    return propagate.extract(carrier)


class JsonLinesSpanExporter(SpanExporter):
    """Finished spans as JSON lines, appended with one write each so processes can share a file."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> SpanExportResult:
        data = "".join(span.to_json(indent=None) + "\n" for span in spans).encode()
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
