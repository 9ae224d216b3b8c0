"""A real gateway HTTP server for the HTTP security tests: uvicorn on a thread of its own (its own
event loop, as in production), in front of a scripted gateway (no NATS: every request is answered
with a few scripted tokens), so that a client's bytes reach it over a real keep-alive socket."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.tokenizer import ModelTokenizer
from tests.support.cluster import free_port
from tests.unit.test_gateway_sse import ScriptedGateway, chunks_for


def tiny_model_dir(home: Path, context: int = 256) -> Path:
    from services.tools.make_model import build_tokenizer

    path = home / "tiny-tok"
    if not path.exists():
        build_tokenizer().save_pretrained(path)
        (path / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return path


def scripted_gateway(model_dir: Path, max_model_len: int | None = None, **config: object) -> ScriptedGateway:
    gateway_config = GatewayConfig(model_dir=str(model_dir), gateway_id="gw-sec", request_inactivity_timeout_s=2.0,
                                   **config)  # type: ignore[arg-type]
    tokenizer = ModelTokenizer.load(str(model_dir), max_model_len, gateway_config.tokenizer_workers)
    gateway = ScriptedGateway(gateway_config, tokenizer)
    gateway.script = chunks_for([40, 41, 42])
    return gateway


@contextmanager
def served(gateway: ScriptedGateway) -> Iterator[tuple[str, int]]:
    """(host, port) of the gateway served on a thread until the block ends."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(gateway), host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="off"))

    async def serve_then_stop_workers() -> None:  # the body parser workers live on the server's loop
        try:
            await server.serve()
        finally:
            await gateway.body_workers.close()

    thread = threading.Thread(target=asyncio.run, args=(serve_then_stop_workers(),), name="gateway-under-test",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.01)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(10)
        gateway.tokenizer.close()
    assert not thread.is_alive(), "the gateway did not stop"
