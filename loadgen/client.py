"""HTTP side: OpenAI-compatible streaming requests over httpx, and the endpoint reachability check."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadgen.errors import LoadgenError
from loadgen.records import RequestRecord, RequestStatus
from loadgen.schedule import ScheduledRequest

API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str  # scheme://host:port, without /v1
    model: str
    api: str = "chat"
    api_key: str | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 3600.0

    @property
    def url(self) -> str:
        return self.base_url + API_PATHS[self.api]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def normalize_base_url(endpoint: str) -> str:
    """Accept http://host:port, …/v1, or a full …/v1/chat/completions URL."""
    url = endpoint.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise LoadgenError(f"endpoint {endpoint!r} must start with http:// or https://")
    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL as exc:
        raise LoadgenError(f"endpoint {endpoint!r} is not a valid URL: {exc}") from None
    if not host:
        raise LoadgenError(f"endpoint {endpoint!r} has no host")
    for suffix in (*API_PATHS.values(), "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def make_client(config: EndpointConfig, max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    return httpx.AsyncClient(limits=limits, timeout=timeout, headers=config.headers)


async def check_endpoint(client: httpx.AsyncClient, config: EndpointConfig) -> list[str]:
    """GET /v1/models: fail fast on an unreachable server; returns the served model ids."""
    url = config.base_url + "/v1/models"
    try:
        response = await client.get(url, timeout=10.0)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise LoadgenError(f"cannot reach endpoint {config.base_url}: {_describe(exc)}") from None
    if response.status_code in (401, 403):
        status = response.status_code
        raise LoadgenError(f"endpoint {config.base_url} refused us (HTTP {status}); check --api-key")
    if response.status_code != 200:
        return []
    try:
        return [str(m.get("id")) for m in response.json().get("data", []) if isinstance(m, dict)]
    except (ValueError, AttributeError):
        return []


def build_payload(request: ScheduledRequest, config: EndpointConfig) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": config.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_tokens,
    }
    if config.api == "chat":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.max_tokens
    else:
        payload["prompt"] = request.prompt
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if request.priority is not None:
        payload["priority"] = request.priority
    payload.update(config.extra_body)
    return payload


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of an SSE byte stream, split on LF (CR LF) only. httpx's `aiter_lines` also splits
    on U+2028 and U+0085, which JSON strings may carry unescaped (random-weight models emit
    them), and would cut an event in two."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
    if pending:
        yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The `data` payloads of a server-sent event stream; comments (`: keep-alive`) skipped."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        # ':' comments and other fields (event:, id:, retry:) carry nothing we use
    if data:
        yield "\n".join(data)


async def send_request(
    client: httpx.AsyncClient, config: EndpointConfig, request: ScheduledRequest, clock_zero: float
) -> RequestRecord:
    """Stream one request and record every content chunk's arrival. Never raises for HTTP trouble."""
    record = RequestRecord(request.index, request.input_len, request.max_tokens, request.priority)
    payload = build_payload(request, config)
    headers = {"X-Request-Id": f"loadgen-{request.index}"}
    record.send_s = time.perf_counter() - clock_zero
    try:
        async with client.stream("POST", config.url, json=payload, headers=headers) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                await _record_http_error(record, response)
            else:
                await _consume_stream(record, response, config.api, clock_zero)
    except httpx.HTTPError as exc:
        _fail(record, _describe(exc))
    record.end_s = time.perf_counter() - clock_zero
    return record


async def _consume_stream(
    record: RequestRecord, response: httpx.Response, api: str, clock_zero: float
) -> None:
    async for data in sse_events(sse_lines(response.aiter_bytes())):
        if data.strip() == "[DONE]":
            break
        arrived_s = time.perf_counter() - clock_zero
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            _fail(record, f"malformed stream event: {data[:_ERROR_TEXT_LIMIT]!r}")
            return
        if not isinstance(event, dict):
            continue
        if event.get("error") is not None:
            _fail(record, _error_message(event))
            return
        _apply_event(record, event, api, arrived_s)
    if not record.chunk_s:
        _fail(record, "the stream ended without any content chunk")
        return
    record.status = RequestStatus.OK
    record.error = None


def _apply_event(record: RequestRecord, event: dict, api: str, arrived_s: float) -> None:
    choices = event.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        content = (choice.get("delta") or {}).get("content") if api == "chat" else choice.get("text")
        if content:
            record.chunk_s.append(arrived_s)
            record.text += content
    usage = event.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)


async def _record_http_error(record: RequestRecord, response: httpx.Response) -> None:
    body = (await response.aread()).decode("utf-8", errors="replace")
    try:
        message = _error_message(json.loads(body))
    except (json.JSONDecodeError, AttributeError, TypeError):
        message = body.strip()
    text = f"HTTP {response.status_code}: {message or response.reason_phrase}"
    _fail(record, text)
    if response.status_code == 429:
        record.status = RequestStatus.REJECTED


def _error_message(event: Any) -> str:
    error = event.get("error", event) if isinstance(event, dict) else event
    if isinstance(error, dict):
        error = error.get("message") or error.get("detail") or json.dumps(error)
    return str(error)[:_ERROR_TEXT_LIMIT]


def _fail(record: RequestRecord, message: str) -> None:
    record.status = RequestStatus.FAILED
    record.error = " ".join(message.split())[:_ERROR_TEXT_LIMIT]  # one line, whatever the body was


def _describe(exc: BaseException) -> str:
    detail = str(exc).strip()
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
