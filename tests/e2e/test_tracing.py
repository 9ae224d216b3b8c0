"""Traces end to end: one request's spans from the gateway, the scheduler and both llumlets of a
migration join the client's trace (real processes, spans written by CORRAL_TRACE_FILE)."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)

from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import DrainOrder, MigrateOrder
from shared.tracing import TRACE_FILE_ENV
from tests.support.cluster import Cluster
from tests.support.stream_watch import StreamWatch

# Real-time simulated A10 steps: ~20 ms per token, so the request below decodes for a few seconds.
SIM = ("--sim-time-scale", "1", "--max-model-len", "2048", "--report-interval-s", "0.05")
SRC, DST = "trace-src", "trace-dst"
OUTPUT_LEN = 150


class OtlpReceiver:
    """A stand-in for Jaeger's OTLP/HTTP port: decodes what the exporters post to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service name, span name, trace id hex)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.take(self.path, self.headers.get("content-type", ""), body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, path: str, content_type: str, body: bytes) -> None:
        assert path == "/v1/traces" and content_type == "application/x-protobuf", (path, content_type)
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                self.spans += [(service, span.name, span.trace_id.hex()) for span in scope_spans.spans]

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def otlp():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tmp_path_factory, otlp):
    logs = tmp_path_factory.mktemp("tracing")
    server = start_nats()
    env = {TRACE_FILE_ENV: str(logs / "spans.jsonl"), "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export batches every 100 ms, not 5 s
    cluster = Cluster(server.url, tiny_model_dir, logs, env=env)
    cluster.start_scheduler()
    cluster.start_llumlet(SRC, *SIM)
    cluster.start_llumlet(DST, *SIM)
    cluster.start_gateway()
    try:
        cluster.wait_ready(instances=2)
        yield cluster, logs / "spans.jsonl"
    finally:
        cluster.stop()
        server.stop()


def read_spans(path: Path, trace_id: str, until, timeout_s: float = 10.0) -> list[dict]:
    """Spans of one trace, once `until(spans)` holds (processes write them as they end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [s for s in map(json.loads, lines) if s["context"]["trace_id"] == f"0x{trace_id}"]
        if until(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def named(spans: list[dict], name: str) -> list[dict]:
    return [s for s in spans if s["name"] == name]


async def test_a_migrated_request_is_one_trace_across_gateway_scheduler_and_both_llumlets(traced):
    cluster, span_file = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    async with StreamWatch(cluster.nats_url) as watch, httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        await watch.order(DST, DrainOrder(drain=True))  # so that the request goes to SRC
        assert await watch.wait_for(lambda latest: DST in latest and latest[DST].draining, 5)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello there", "max_tokens": OUTPUT_LEN, "ignore_eos": True}
        headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
        reply = asyncio.create_task(http.post("/v1/completions", json=body, headers=headers))
        assert await watch.wait_for(lambda latest: latest[SRC].num_running == 1, 10)
        await watch.order(DST, DrainOrder(drain=False))
        pair = f"trace-{uuid.uuid4().hex[:6]}"
        await watch.order(SRC, MigrateOrder(pair, DST))
        reply = await reply
        await watch.order(SRC, MigrateOrder(pair, DST, cancel=True))
        (request_id,) = watch.chunks
        assert await watch.wait_finished(request_id)
        publishers = watch.publishers(request_id)
    assert reply.status_code == 200, reply.text
    assert publishers == [SRC, DST], f"the request was not migrated once: {publishers}"

    spans = read_spans(span_file, trace_id, lambda s: len(s) >= 4)
    (gateway,) = named(spans, f"text_completion {model}")
    (dispatch,) = named(spans, f"process {subjects.DISPATCH}")
    engine_spans = sorted(named(spans, "llm_request"), key=lambda s: s["start_time"])
    assert [s["attributes"]["corral.instance_id"] for s in engine_spans] == [SRC, DST]
    source, destination = engine_spans

    gateway_id = gateway["context"]["span_id"]
    assert gateway["parent_id"] == f"0x{client_span}"  # continues the client's trace
    assert dispatch["parent_id"] == gateway_id and source["parent_id"] == gateway_id
    assert destination["parent_id"] == gateway_id  # the context travelled with the migrated request
    assert dispatch["attributes"]["corral.instance_id"] == SRC

    assert gateway["attributes"]["gen_ai.usage.output_tokens"] == OUTPUT_LEN
    assert gateway["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert gateway["attributes"]["corral.instances"] == [SRC, DST]
    assert gateway["attributes"]["gen_ai.latency.time_to_first_token"] > 0
    assert source["attributes"]["corral.end"] == "migrated_out"
    assert destination["attributes"]["corral.migrated_in"] is True
    assert destination["attributes"]["corral.end"] == "finished"
    assert destination["attributes"]["gen_ai.usage.output_tokens"] == OUTPUT_LEN
    assert 0 < destination["attributes"]["corral.output_tokens_before"] < OUTPUT_LEN


async def test_a_rejected_request_still_leaves_its_span(traced):
    cluster, span_file = traced
    trace_id = secrets.token_hex(16)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as http:
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        reply = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6}, headers=headers)
    assert reply.status_code == 400
    (span,) = read_spans(span_file, trace_id, lambda s: len(s) >= 1)
    assert span["attributes"]["http.response.status_code"] == 400
    assert span["status"]["status_code"] == "UNSET"  # a client error is not a failed server span


async def test_every_service_exports_its_spans_over_otlp(traced, otlp):
    cluster, _ = traced
    trace_id = secrets.token_hex(16)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as http:
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        reply = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}, headers=headers)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 10
    while len(services := {svc for svc, _, tid in otlp.spans if tid == trace_id}) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert services == {"corral-gateway", "corral-global-scheduler", "corral-llumlet"}
