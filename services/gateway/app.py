"""HTTP routes: the OpenAI-compatible API (JSON and SSE), /v1/models, /healthz and /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from services.gateway.generation import Generation
from services.gateway.metrics import CONTENT_TYPE, timeline_of
from services.gateway.protocol import (
    ApiError, ParsedRequest, RequestKind, bad_request, parse_chat_request, parse_completion_request, parse_priority,
)
from services.gateway.responses import SSE_DONE, ResponseFormatter, json_bytes, sse_error, sse_event
from services.gateway.service import GatewayService, PreparedRequest
from services.gateway.streams import OutputStream
from services.gateway.tracing import RequestTrace
from services.gateway.tokenizer import PromptError

log = logging.getLogger(__name__)

PRIORITY_HEADER = "x-corral-priority"
REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED = 499  # nginx's status for "the client went away first"


class EventStreamResponse(StreamingResponse):
    """SSE that always notices a client leaving and always closes its generator.

    Starlette's StreamingResponse stops listening for disconnects under ASGI 2.4 and leaves the
    generator suspended when a send fails; our generator's `finally` aborts the request upstream,
    so it must run promptly in every case.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], headers: Mapping[str, str]) -> None:
        super().__init__(content, headers=headers)
        self._on_close = on_close  # for a generator that never started, so its `finally` never ran

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client is gone; the generator is closed below
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            iterator = self.body_iterator
            if hasattr(iterator, "aclose"):
                with anyio.CancelScope(shield=True):
                    await iterator.aclose()
            self._on_close()


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _read_json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class GatewayApp:
    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self.config = service.config
        self._model_names = {self.config.model_name, self.config.model_dir, str(Path(self.config.model_dir).resolve())}

    # ---- OpenAI endpoints -------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", parse_chat_request, RequestKind.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", parse_completion_request, RequestKind.COMPLETION)

    async def _generate(self, request: Request, endpoint: str, parse: Any, kind: RequestKind) -> Response:
        arrival = time.monotonic()
        trace = RequestTrace(kind, self.config.model_name, request.headers)
        try:
            with trace.current():  # the scheduler's and the llumlet's spans are its children
                parsed: ParsedRequest = parse(await _read_json(request))
                prepared = await self._prepare(parsed, request.headers, arrival)
                options = parsed.options
                trace.prepared(prepared.request_id, prepared.response_id, len(prepared.prompt_token_ids),
                               prepared.max_tokens, options.temperature, options.top_p, options.seed,
                               prepared.priority, options.stream)
                stream = await self.service.submit(prepared)
        except ApiError as error:
            self.service.metrics.request_done(endpoint, error.status)
            trace.rejected(error)
            raise
        except BaseException:
            trace.span.end()
            raise
        generation = Generation(stream, self.service.tokenizer.decode, prepared.prompt_token_ids, parsed.options,
                                self.config.request_inactivity_timeout_s, prepared.arrival)
        formatter = ResponseFormatter(parsed.kind, prepared.response_id, prepared.created, self.config.model_name)
        headers = {"x-request-id": request.headers[REQUEST_ID_HEADER]} if REQUEST_ID_HEADER in request.headers else {}
        if parsed.options.stream:
            events = self._event_stream(generation, formatter, prepared, endpoint, trace)
            on_close = partial(self._finish, generation, prepared, endpoint, trace, CLIENT_CLOSED)
            return EventStreamResponse(events, on_close, headers={"cache-control": "no-cache", **headers})
        return await self._complete(request, generation, formatter, prepared, endpoint, trace, headers)

    async def _prepare(self, parsed: ParsedRequest, headers: Mapping[str, str], arrival: float) -> PreparedRequest:
        if parsed.model is not None and parsed.model not in self._model_names:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", "model")
        priority = parsed.options.priority
        if priority is None:
            header = headers.get(PRIORITY_HEADER)
            priority = 0 if header is None else parse_priority(header, "X-Corral-Priority")
        prompt_ids = await self._tokenize(parsed)
        given_id = headers.get(REQUEST_ID_HEADER)
        response_id = f"{parsed.kind.id_prefix}-{given_id}" if given_id else None  # vLLM's convention
        return self.service.prepare(parsed.kind, prompt_ids, parsed.options, priority, response_id, arrival)

    async def _tokenize(self, parsed: ParsedRequest) -> list[int]:
        tokenizer = self.service.tokenizer
        if isinstance(parsed.prompt, list):
            return parsed.prompt
        try:
            if parsed.kind is RequestKind.CHAT:
                assert parsed.messages is not None
                return await tokenizer.apply_chat_template_async(parsed.messages)
            assert isinstance(parsed.prompt, str)
            return await tokenizer.encode_async(parsed.prompt)
        except PromptError as exc:
            raise bad_request(str(exc), "messages" if parsed.kind is RequestKind.CHAT else "prompt") from None

    async def _event_stream(self, generation: Generation, formatter: ResponseFormatter, prepared: PreparedRequest,
                            endpoint: str, trace: RequestTrace) -> AsyncIterator[bytes]:
        options = prepared.options
        status = CLIENT_CLOSED  # until the stream got to its end
        try:
            if formatter.kind is RequestKind.CHAT:
                yield sse_event(formatter.role_chunk())
            async for event in generation.events():
                if event.text or event.finish_reason:
                    usage = generation.usage() if options.continuous_usage_stats else None
                    yield sse_event(formatter.text_chunk(event.text, event.finish_reason, usage))
                if event.error is not None:
                    yield sse_error(event.error)
            if generation.finish_reason is not None and options.include_usage:
                yield sse_event(formatter.usage_chunk(generation.usage()))
            status = generation.error.status if generation.error is not None else 200
            yield SSE_DONE
        finally:
            self._finish(generation, prepared, endpoint, trace, status)

    async def _complete(self, request: Request, generation: Generation, formatter: ResponseFormatter,
                        prepared: PreparedRequest, endpoint: str, trace: RequestTrace,
                        headers: dict[str, str]) -> Response:
        async def collect() -> str:
            return "".join([event.text async for event in generation.events()])

        collecting = asyncio.create_task(collect())
        disconnect = asyncio.create_task(_wait_for_disconnect(request.receive))
        status = CLIENT_CLOSED
        try:
            await asyncio.wait({collecting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                return Response(status_code=CLIENT_CLOSED)
            text = collecting.result()
            if generation.error is not None:
                status = generation.error.status
                return error_response(generation.error)
            assert generation.finish_reason is not None
            status = 200
            body = formatter.full_response(text, generation.finish_reason, generation.usage())
            return Response(json_bytes(body), media_type="application/json", headers=headers)
        finally:
            for task in (collecting, disconnect):
                task.cancel()
            await asyncio.gather(collecting, disconnect, return_exceptions=True)
            self._finish(generation, prepared, endpoint, trace, status)

    def _finish(self, generation: Generation, prepared: PreparedRequest, endpoint: str, trace: RequestTrace,
                status: int) -> None:
        """Release the request and record how it ended; only the first call for a request counts."""
        stream: OutputStream = generation.stream
        if not self.service.release(stream, abort=not stream.upstream_finished):
            return
        metrics = self.service.metrics
        metrics.request_done(endpoint, status)
        if stream.holders:
            metrics.request_finished(timeline_of(generation, prepared, stream.holders[-1]))
        ttft = None if generation.first_token_at is None else generation.first_token_at - prepared.arrival
        trace.finished(status, generation.finish_reason, generation.error, generation.num_output_tokens, ttft,
                       stream.holders)

    # ---- the rest ---------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.config.model_name, "object": "model", "created": self.service.started_at, "owned_by": "corral",
            "root": self.config.model_dir, "parent": None, "max_model_len": self.service.tokenizer.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def healthz(self, request: Request) -> Response:
        body = {"gateway_id": self.config.gateway_id, "instances": self.service.instances.alive_count()}
        if not self.service.connected:
            return JSONResponse({"status": "not connected to NATS", **body}, status_code=503)
        return JSONResponse({"status": "ok", **body})

    async def metrics(self, request: Request) -> Response:
        return Response(self.service.metrics.render(), media_type=CONTENT_TYPE)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.status_code, exc.detail, headers=exc.headers))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def create_app(service: GatewayService) -> Starlette:
    gateway = GatewayApp(service)
    routes = [
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/healthz", gateway.healthz, methods=["GET"]),
        Route("/health", gateway.healthz, methods=["GET"]),  # vLLM's path, for tools that probe it
        Route("/metrics", gateway.metrics, methods=["GET"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _unexpected_error}
    return Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
