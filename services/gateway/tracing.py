"""The gateway's span per request, named and tagged by OpenTelemetry's GenAI conventions.

It continues the client's trace (a `traceparent` header) or starts one, and is the parent of the
global scheduler's dispatch span and of the llumlets' `llm_request` spans: the gateway injects it
into the NATS messages it sends while the span is current.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.gateway.errors import ApiError
from services.gateway.protocol import RequestKind
from shared import tracing

_tracer = tracing.tracer("corral.gateway")


def operation_name(kind: RequestKind) -> str:
    return "chat" if kind is RequestKind.CHAT else "text_completion"


class RequestTrace:
    def __init__(self, kind: RequestKind, model: str, headers: Mapping[str, str]) -> None:
        operation = operation_name(kind)
        self.span = _tracer.start_span(
            f"{operation} {model}", context=tracing.extract(headers), kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "gen_ai.provider.name": "corral",
                        "gen_ai.request.model": model},
        )

    def current(self) -> AbstractContextManager:
        """Make the span current, so that messages sent meanwhile carry it."""
        return trace.use_span(self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    def prepared(self, request_id: str, response_id: str, num_prompt_tokens: int, max_tokens: int,
                 temperature: float, top_p: float, seed: int | None, priority: int, stream: bool) -> None:
        if not self.span.is_recording():
            return
        self.span.set_attributes({
            "corral.request_id": request_id, "gen_ai.response.id": response_id,
            "gen_ai.usage.input_tokens": num_prompt_tokens, "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": temperature, "gen_ai.request.top_p": top_p,
            "corral.priority": priority, "corral.stream": stream,
        })
        if seed is not None:
            self.span.set_attribute("gen_ai.request.seed", seed)

    def rejected(self, error: ApiError) -> None:
        """The request never reached an instance."""
        self.span.set_attribute("http.response.status_code", error.status)
        if error.status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, error.message))
        self.span.end()

    def finished(self, status: int, finish_reason: str | None, error: ApiError | None, num_output_tokens: int,
                 time_to_first_token_s: float | None, instances: Sequence[str]) -> None:
        span = self.span
        if span.is_recording():
            span.set_attributes({"http.response.status_code": status, "gen_ai.usage.output_tokens": num_output_tokens,
                                 "corral.instances": list(instances)})
            if finish_reason is not None:
                span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
            if time_to_first_token_s is not None:
                span.set_attribute("gen_ai.latency.time_to_first_token", time_to_first_token_s)
            if status >= 500:  # HTTP server conventions: a 4xx is the client's, not a failed span
                span.set_status(Status(StatusCode.ERROR, error.message if error else f"status {status}"))
        span.end()
