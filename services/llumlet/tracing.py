"""The llumlet's span per request while it is here: `llm_request`, as vLLM names its own.

A child of the gateway's request span (its context arrives in the generate message's headers and
travels on in the request, so a migrated request's span on the destination joins the same trace).
A request that moves has one span per instance: the source's ends with `corral.end=migrated_out`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shared.engine_model.views import StepOutput
from shared import tracing
from shared.messages import FinishReason, GenerateRequest

_tracer = tracing.tracer("corral.llumlet")
TRACE_HEADERS = ("traceparent", "tracestate")


def trace_context_of(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """The W3C trace-context headers of a message, if it has any."""
    if not headers:
        return None
    carrier = {key: headers[key] for key in TRACE_HEADERS if key in headers}
    return carrier or None


@dataclass
class _OpenSpan:
    span: Span
    started: float  # time.monotonic()
    migrated_in: bool
    first_token_seen: bool = False


class RequestSpans:
    def __init__(self, instance_id: str, model: str) -> None:
        self.instance_id = instance_id
        self.model = model
        self.enabled = tracing.enabled()  # off: no span, no bookkeeping
        self._open: dict[str, _OpenSpan] = {}

    def __len__(self) -> int:
        return len(self._open)

    def started(self, request: GenerateRequest, migrated_in: bool = False, num_output_tokens: int = 0) -> None:
        if not self.enabled or request.request_id in self._open:
            return
        sampling = request.sampling
        span = _tracer.start_span("llm_request", context=tracing.extract(request.trace_context), kind=SpanKind.SERVER,
                                  attributes={
                                      "gen_ai.request.id": request.request_id, "gen_ai.request.model": self.model,
                                      "gen_ai.request.max_tokens": sampling.max_tokens,
                                      "gen_ai.request.temperature": sampling.temperature,
                                      "gen_ai.request.top_p": sampling.top_p,
                                      "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                                      "corral.instance_id": self.instance_id, "corral.priority": request.priority,
                                      "corral.migrated_in": migrated_in,
                                      "corral.output_tokens_before": num_output_tokens,
                                  })
        self._open[request.request_id] = _OpenSpan(span, time.monotonic(), migrated_in)

    def output(self, output: StepOutput) -> None:
        if not self.enabled:
            return
        entry = self._open.get(output.request_id)
        if entry is None:
            return
        if output.token_ids and not entry.first_token_seen:
            entry.first_token_seen = True
            # After a migration, the time to this instance's first token is what the move cost.
            name = "corral.latency.time_to_first_token_here" if entry.migrated_in else "gen_ai.latency.time_to_first_token"
            entry.span.set_attribute(name, time.monotonic() - entry.started)
        if output.finish_reason is not None:
            entry.span.set_attributes({
                "gen_ai.response.finish_reasons": [output.finish_reason.value],
                "gen_ai.usage.output_tokens": output.start_index + len(output.token_ids),
                "corral.num_preemptions": output.num_preemptions,
            })
            failed = output.finish_reason is FinishReason.ERROR
            self.ended(output.request_id, "finished", error="the engine failed the request" if failed else None)

    def ended(self, request_id: str, how: str, error: str | None = None) -> None:
        """The request left this instance: finished, aborted, failed or migrated out."""
        entry = self._open.pop(request_id, None) if self.enabled else None
        if entry is None:
            return
        entry.span.set_attribute("corral.end", how)
        if error is not None:
            entry.span.set_status(Status(StatusCode.ERROR, error))
        entry.span.end()

    def end_all(self, how: str, error: str | None = None) -> None:
        for request_id in list(self._open):
            self.ended(request_id, how, error)
