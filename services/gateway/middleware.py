"""ASGI middleware around the routes: API keys, request ids and CORS, as vLLM's server has them;
a bound on the request body, and unexpected errors answered without dropping the connection.

Pure ASGI (no BaseHTTPMiddleware): they must not buffer or delay a streamed response.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import uuid
from collections.abc import Sequence

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, error_response

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
GENERATED_ID_STATE = "generated_request_id"
GUARDED_PREFIX = "/v1"  # vLLM's: health, readiness, metrics, version and tokenize stay open


GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
BUSY_KEY_HEADERS = {"retry-after": "1"}


class ApiKeyMiddleware:
    """401 on /v1 routes without `Authorization: Bearer <one of the keys>`. Keys are compared as
    SHA-256 digests with `secrets.compare_digest` over every key: the time taken does not tell
    how much of a key was right, nor which key matched.

    With `max_streams_per_key`, a key with that many generation requests in progress (streamed or
    not, until their response ends) gets a 429 with Retry-After for the next one."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], max_streams_per_key: int | None = None) -> None:
        assert keys, "no API keys: leave the middleware out"
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        self._max_streams = max_streams_per_key
        self._in_progress = [0] * len(keys)  # generation requests per key

    def matched_key(self, headers: Headers) -> int | None:
        """The index of the key the request carries; None: no valid key."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(token.strip().encode()).digest()
        matched = None
        for index, known in enumerate(self._digests):
            equal = secrets.compare_digest(digest, known)
            matched = index if equal else matched
        return matched if scheme.lower() == "bearer" else None

    def authorized(self, headers: Headers) -> bool:
        return self.matched_key(headers) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not _guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        key = self.matched_key(Headers(scope=scope))
        if key is None:
            error = ApiError(401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                             headers={"www-authenticate": "Bearer"})
            await error_response(error)(scope, receive, send)
            return
        if self._max_streams is None or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self._in_progress[key] >= self._max_streams:
            error = ApiError(429, f"this API key has {self._in_progress[key]} requests in progress, its limit "
                                  "(--max-streams-per-key); retry when one has ended", headers=BUSY_KEY_HEADERS)
            await error_response(error)(scope, receive, send)
            return
        self._in_progress[key] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_progress[key] -= 1


def _guarded(path: str) -> bool:
    return path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/")


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the client's when it sent one, else a new one, which
    is also put into the request so that the handler uses it (the response id ends with it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get(REQUEST_ID_HEADER)
        if not request_id:
            request_id = uuid.uuid4().hex
            scope = dict(scope, headers=[*scope["headers"], (REQUEST_ID_HEADER.encode(), request_id.encode())])
            # Ours, so unique and subject-safe: the handler may name the request itself after it.
            scope.setdefault("state", {})[GENERATED_ID_STATE] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER not in headers:
                    headers.append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as soon as the
    bytes read pass it (a chunked body has no Content-Length), before anything parses it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than this gateway's limit of {self.max_bytes} bytes "
                             "(--max-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await error_response(self.too_large())(scope, receive, send)
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large()  # an ApiError: the routes' handler answers it
            return message

        await self.app(scope, bounded_receive, send)


class UnexpectedErrorMiddleware:
    """A bug's exception becomes an OpenAI-shaped 500 here, and goes no further: Starlette's own
    last-resort handler re-raises it after answering, and uvicorn then closes the connection, so
    the client's next request on that keep-alive connection would be reset."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as exc:
            if started:
                raise  # half a response went out: nothing sensible can follow it
            if isinstance(exc, ApiError):  # raised where no route's handler saw it (a 413 from receive)
                await error_response(exc)(scope, receive, send)
                return
            log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
            await error_response(error)(scope, receive, send)


def middleware_for(config: GatewayConfig) -> list[Middleware]:
    """Outermost first: CORS answers preflights and decorates every response (401s and 413s
    included), then the request id, then the key check, the body bound and the last-resort 500."""
    stack = [
        Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=list(config.allowed_methods),
                   allow_headers=list(config.allowed_headers), allow_credentials=config.allow_credentials,
                   expose_headers=[REQUEST_ID_HEADER]),
        Middleware(RequestIdMiddleware),
    ]
    if config.api_keys:
        stack.append(Middleware(ApiKeyMiddleware, keys=config.api_keys, max_streams_per_key=config.max_streams_per_key))
    stack += [Middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes),
              Middleware(UnexpectedErrorMiddleware)]
    return stack
