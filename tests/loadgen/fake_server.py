"""A small OpenAI-compatible streaming server for the loadgen tests (Starlette on uvicorn).

It streams `chunks` content chunks per request (fewer if max_tokens is smaller), interleaves an
SSE keep-alive comment, reports usage when asked, answers HTTP 429 to every `reject_every`-th
request and sends a mid-stream error event to every `error_every`-th one (by X-Request-Id index).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeBehaviour:
    chunks: int = 4
    gap_s: float = 0.005
    reject_every: int = 0
    error_every: int = 0
    bodies: list[dict] = field(default_factory=list)


def _index(request: Request) -> int:
    return int(request.headers.get("x-request-id", "loadgen-0").rsplit("-", 1)[-1])


def build_app(behaviour: FakeBehaviour) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        behaviour.bodies.append(body)
        index = _index(request)
        if behaviour.reject_every and index % behaviour.reject_every == 0:
            error = {"message": "too many requests", "type": "RateLimitError", "code": 429}
            return JSONResponse({"error": error}, status_code=429)
        chat = request.url.path.endswith("/chat/completions")
        fail = bool(behaviour.error_every and index % behaviour.error_every == 1)
        return StreamingResponse(_stream(body, chat, fail, behaviour), media_type="text/event-stream")

    routes = [
        Route("/v1/models", models),
        Route("/v1/chat/completions", complete, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def _stream(body: dict, chat: bool, fail: bool, behaviour: FakeBehaviour):
    created = int(time.time())
    count = min(behaviour.chunks, int(body.get("max_tokens", behaviour.chunks)))

    def event(payload: dict) -> str:
        return f"data: {json.dumps({'id': 'x', 'created': created, **payload})}\n\n"

    def choice(text: str, finish: str | None = None) -> dict:
        if chat:
            return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "finish_reason": finish}

    if chat:
        yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    yield ": keep-alive\n\n"
    for position in range(count):
        await asyncio.sleep(behaviour.gap_s)
        if fail and position == 1:
            yield event({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
            yield "data: [DONE]\n\n"
            return
        yield event({"choices": [choice(f"t{position} ")]})
    yield event({"choices": [choice("", "length")]})
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 7, "completion_tokens": count, "total_tokens": 7 + count}
        yield event({"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


class FakeServer:
    """Runs the app on a free local port inside the current event loop."""

    def __init__(self, behaviour: FakeBehaviour) -> None:
        self.behaviour = behaviour
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        config = uvicorn.Config(build_app(behaviour), log_level="warning", lifespan="off", ws="none")
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()
        return f"http://{host}:{port}"

    async def __aenter__(self) -> FakeServer:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            assert not self._task.done(), "fake server failed to start"
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        assert self._task is not None
        await self._task
        self._socket.close()
