"""/openapi.json: an OpenAPI 3.1 document of every route, its body and its answers.

The request and response bodies are typed models (msgspec Structs with the parser's limits as
constraints); their JSON Schemas are generated from them. The parser (`protocol`) stays the judge
of what is accepted; a test holds the two together by sending schema examples through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from starlette.routing import Route

from services.gateway.info_routes import corral_version
from services.gateway.protocol import (
    INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_MESSAGES, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
NonNegative = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Positive = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Priority = Int64 | Literal["high", "normal"]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Content = str | list["TextPart"]
StopString = Annotated[str, Meta(max_length=MAX_STOP_STRING_CHARS)]
Messages = Annotated[list["ChatMessage"], Meta(min_length=1, max_length=MAX_MESSAGES)]


class _Body(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Unknown fields are ignored, as vLLM's server ignores them."""


class TextPart(_Body):
    type: Literal["text"]
    text: str


class _Message(_Body, tag_field="role"):
    """A chat turn, by role; text content only."""


class SystemMessage(_Message, tag="system"):
    content: Content


class DeveloperMessage(_Message, tag="developer"):
    content: Content


class UserMessage(_Message, tag="user"):
    content: Content


class ToolMessage(_Message, tag="tool"):
    content: Content


class AssistantMessage(_Message, tag="assistant"):
    content: Content | None = None  # none: a turn that only called tools


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | ToolMessage | AssistantMessage


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Sampling(_Body):
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None  # only with stream: true
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    max_tokens: Positive | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    seed: Int64 | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegative | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    include_stop_str_in_output: bool | None = None
    priority: Priority | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Messages
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None  # the vLLM engine only (the simulated one answers 400)
    top_logprobs: TopLogprobs | None = None  # needs logprobs: true


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[TokenId], Meta(min_length=1)]
    logprobs: TopLogprobs | None = None  # the vLLM engine only (the simulated one answers 400)


class TokenizeCompletionRequest(_Body):
    prompt: str
    model: str | None = None
    add_special_tokens: bool | None = None  # (null: the default, true)
    return_token_strs: bool | None = None


class TokenizeChatRequest(_Body):
    messages: Messages
    model: str | None = None
    add_generation_prompt: bool | None = None  # (null: the default, true)
    continue_final_message: bool | None = None  # not with add_generation_prompt true
    return_token_strs: bool | None = None


class DetokenizeRequest(_Body):
    tokens: list[NonNegative]
    model: str | None = None


class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Body):
    error: ErrorInfo


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # --enable-prompt-tokens-details


class TopLogprob(_Body):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprobEntry]


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Body):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Model(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: None = None


class ModelList(_Body):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Body):
    prompt: str


class Version(_Body):
    version: str


class Health(_Body):
    status: str
    gateway_id: str
    connected: bool
    instances: int


class Readiness(_Body):
    status: str
    gateway_id: str
    connected: bool
    instances: int


# path -> (summary, request body model, JSON answer model for 200, error statuses, streams SSE, open)
_Spec = tuple[str, Any, Any, tuple[int, ...], bool, bool]
_GENERATION_ERRORS = (400, 401, 404, 409, 413, 429, 503, 504)  # 413: over --max-body-bytes
ROUTE_SPECS: dict[str, _Spec] = {
    "/v1/chat/completions": ("Chat completion (JSON, or SSE with stream: true)", ChatCompletionRequest,
                             ChatCompletion, _GENERATION_ERRORS, True, False),
    "/v1/completions": ("Text completion (JSON, or SSE with stream: true)", CompletionRequest, Completion,
                        _GENERATION_ERRORS, True, False),
    "/v1/models": ("The served model", None, ModelList, (401,), False, False),
    "/v1/models/{model}": ("One model by id", None, Model, (401, 404), False, False),
    "/tokenize": ("vLLM's /tokenize", (TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse,
                  (400, 404, 413), False, True),
    "/detokenize": ("vLLM's /detokenize", DetokenizeRequest, DetokenizeResponse, (400, 404, 413), False, True),
    "/health": ("Liveness: 200 while the process serves", None, Health, (), False, True),
    "/healthz": ("Liveness (alias of /health)", None, Health, (), False, True),
    "/ready": ("Readiness: 200 when connected to NATS with a live instance, else 503", None, Readiness, (503,),
               False, True),
    "/version": ("Corral's version", None, Version, (), False, True),
    "/metrics": ("Prometheus metrics (text exposition)", None, None, (), False, True),
    "/openapi.json": ("This document", None, None, (), False, True),
}


def _ref(model: Any) -> dict[str, Any]:
    """A schema reference; a tuple of models is "any of them" (msgspec wants tagged unions)."""
    models = model if isinstance(model, tuple) else (model,)
    schemas, _ = msgspec.json.schema_components(models, ref_template="#/components/schemas/{name}")
    return schemas[0] if len(schemas) == 1 else {"anyOf": list(schemas)}


def _operation(path: str, method: str, spec: _Spec) -> dict[str, Any]:
    summary, body, answer, errors, streams, open_route = spec
    content: dict[str, Any] = {"application/json": {"schema": _ref(answer)}} if answer is not None else {
        "text/plain" if path == "/metrics" else "application/json": {"schema": {}}}
    if streams:
        # Each event: `data: <a chunk as JSON>` (or `[DONE]`, or an error object mid-stream).
        content["text/event-stream"] = {"schema": {"type": "object", "properties": {"data": {"type": "string"}},
                                                   "required": ["data"]}}
    operation: dict[str, Any] = {
        "summary": summary,
        "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '') or 'root'}",
        "responses": {"200": {"description": "OK", "content": content}},
    }
    if "{model}" in path:
        operation["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    for status in errors:
        described = "Not ready" if path == "/ready" else "Error"
        schema = _ref(Readiness) if path == "/ready" else _ref(ErrorResponse)
        operation["responses"][str(status)] = {"description": described,
                                               "content": {"application/json": {"schema": schema}}}
    if not open_route:
        operation["security"] = [{"bearer": []}, {}]  # a key when the gateway was started with --api-key
    return operation


# What the types cannot say: a field that is only valid with another one set to a value.
_STREAM = ("stream_options", "stream", True)
_CONDITIONS = {
    "ChatCompletionRequest": [_STREAM, ("top_logprobs", "logprobs", True)],
    "CompletionRequest": [_STREAM],
}


def _needs(field: str, other: str, value: Any) -> dict[str, Any]:
    """JSON Schema for "when `field` is given (not null), `other` must be `value`"."""
    return {"if": {"properties": {field: {"not": {"type": "null"}}}, "required": [field]},
            "then": {"properties": {other: {"const": value}}, "required": [other]}}


def openapi_document(routes: Sequence[Route]) -> dict[str, Any]:
    """The document for `routes` (and /openapi.json itself); a route without a spec is a bug."""
    paths: dict[str, Any] = {}
    for route in [*routes, Route("/openapi.json", lambda request: None, methods=["GET"])]:
        path = route.path.replace("{model:path}", "{model}")
        assert path in ROUTE_SPECS, f"route {path} has no OpenAPI description"
        methods = sorted(m for m in route.methods or () if m != "HEAD")
        paths[path] = {m.lower(): _operation(path, m.lower(), ROUTE_SPECS[path]) for m in methods}
    models = [m for spec in ROUTE_SPECS.values() for i in (1, 2)
              for m in (spec[i] if isinstance(spec[i], tuple) else (spec[i],)) if m is not None] + [ErrorResponse]
    _, components = msgspec.json.schema_components(models, ref_template="#/components/schemas/{name}")
    for name, conditions in _CONDITIONS.items():
        components[name]["allOf"] = [_needs(field, other, value) for field, other, value in conditions]
    # A batch of one prompt is taken as that prompt (msgspec's types cannot say "or a list of one").
    components["CompletionRequest"]["properties"]["prompt"]["anyOf"] += [
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "minItems": 1, "maxItems": 1,
         "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}, "minItems": 1}},
    ]
    return {
        "openapi": "3.1.0",
        "info": {"title": "Corral gateway", "version": corral_version(),
                 "description": "OpenAI-compatible API in front of Corral's inference instances."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
