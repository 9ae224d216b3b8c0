"""The HTTP application: routes, middleware and error handlers. The OpenAI endpoints' work is in
`completions`, the others' in `info_routes`, the middleware (API keys, request ids, CORS) in
`middleware`; `openapi` describes them all."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from services.gateway.completions import CompletionEndpoint
from services.gateway.errors import ApiError, error_response
from services.gateway.info_routes import InfoRoutes
from services.gateway.middleware import middleware_for
from services.gateway.openapi import openapi_document
from services.gateway.protocol import RequestKind
from services.gateway.service import GatewayService

__all__ = ["EventStreamResponse", "create_app", "error_response"]


class EventStreamResponse(StreamingResponse):
    """SSE that always notices a client leaving and always closes its generator.

    Starlette's StreamingResponse stops listening for disconnects under ASGI 2.4 and leaves the
    generator suspended when a send fails; our generator's `finally` aborts the request upstream,
    so it must run promptly in every case.

    `on_close` (which releases the request and aborts it upstream; a second call does nothing)
    runs the moment the client is seen gone, before the generator is cancelled and closed: on a
    loop busy with thousands of streams each of those steps waits a full pass of the loop, and
    the abort should not wait for them.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], headers: Mapping[str, str]) -> None:
        super().__init__(content, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        self._on_close()  # the client is gone; the generator is closed below
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                self._on_close()
                group.cancel_scope.cancel()
        finally:
            iterator = self.body_iterator
            if hasattr(iterator, "aclose"):
                with anyio.CancelScope(shield=True):
                    await iterator.aclose()
            self._on_close()


def _event_stream_response(events: AsyncIterator[bytes], on_close: Callable[[], None]) -> StreamingResponse:
    return EventStreamResponse(events, on_close, headers={"cache-control": "no-cache"})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.status_code, exc.detail, headers=exc.headers))


def create_app(service: GatewayService) -> Starlette:
    info = InfoRoutes(service)
    completions = CompletionEndpoint(service, info.check_model, _event_stream_response)

    async def chat(request: Request) -> Response:
        return await completions.handle(request, "/v1/chat/completions", RequestKind.CHAT)

    async def completion(request: Request) -> Response:
        return await completions.handle(request, "/v1/completions", RequestKind.COMPLETION)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/models", info.models, methods=["GET"]),
        Route("/v1/models/{model:path}", info.model, methods=["GET"]),
        Route("/tokenize", info.tokenize, methods=["POST"]),
        Route("/detokenize", info.detokenize, methods=["POST"]),
        Route("/health", info.health, methods=["GET"]),  # liveness, vLLM's path
        Route("/healthz", info.health, methods=["GET"]),
        Route("/ready", info.ready, methods=["GET"]),  # readiness: connected, with a live instance
        Route("/version", info.version, methods=["GET"]),
        Route("/metrics", info.metrics, methods=["GET"]),
    ]
    document = openapi_document(routes)

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    routes.append(Route("/openapi.json", openapi, methods=["GET"]))
    # Other exceptions: middleware.UnexpectedErrorMiddleware (a 500 that keeps the connection).
    handlers: Mapping[type[Exception], Callable] = {ApiError: _api_error, HTTPException: _http_error}
    return Starlette(routes=routes, middleware=middleware_for(service.config),
                     exception_handlers=handlers)  # type: ignore[arg-type]
