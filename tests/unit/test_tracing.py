"""shared.tracing: context over message headers, the JSON-lines exporter, off by default."""

from __future__ import annotations

import json

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import use_span

from shared import tracing


def test_tracing_is_off_without_configuration(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", tracing.TRACE_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.tracing_configured()
    assert tracing.inject() is None  # nothing to carry: messages go without headers


def test_sdk_disabled_wins_over_an_endpoint(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.tracing_configured()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    assert tracing.tracing_configured()


def test_headers_without_a_traceparent_start_a_new_trace():
    assert tracing.extract(None) is None
    assert tracing.extract({}) is None
    assert tracing.extract({"content-type": "x"}) is None


def test_context_round_trips_through_headers_and_spans_land_in_the_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing.JsonLinesSpanExporter(str(path))))
    tracer = provider.get_tracer("test")
    parent = tracer.start_span("parent")
    with use_span(parent, end_on_exit=True):
        headers = tracing.inject()
    assert headers is not None and headers["traceparent"].startswith("00-")
    child = tracer.start_span("child", context=tracing.extract(headers))
    child.end()
    provider.shutdown()

    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert spans["child"]["context"]["trace_id"] == spans["parent"]["context"]["trace_id"]
    assert spans["child"]["parent_id"] == spans["parent"]["context"]["span_id"]
