"""Running a gateway: uvicorn in the current event loop, until SIGINT/SIGTERM, then a clean stop."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal

import uvicorn
import uvloop

from services.gateway.app import create_app
from services.gateway.config import ConfigError, GatewayConfig, add_arguments, config_from_args
from services.gateway.service import GatewayService
from shared import nats_auth

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 10.0


async def serve(config: GatewayConfig) -> None:
    """Serve until SIGINT/SIGTERM; then fail the open requests (aborting them on their instances),
    let their responses end, and drain NATS."""
    try:
        service = GatewayService(config)
    except ConfigError as exc:
        raise SystemExit(f"gateway: {exc}") from None  # a message, not a traceback
    await service.start()
    await service.body_workers.start()  # (in-process tests start them on the first large body)
    server = uvicorn.Server(uvicorn.Config(
        create_app(service), host=config.host, port=config.port, log_config=None, access_log=False,
        lifespan="off", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    ))
    # What startup made (the modules imported, torch's among them: ~390k objects) lives as long
    # as the process. Out of the collector's sight, a full collection walks only what requests
    # made: ~50 ms instead of ~600 ms with 1,000 streams open (benchmarks/gateway_gc.py). Such a
    # pause holds the GIL, so it stalls the event loop and the heartbeat thread alike (seen: 3 s
    # under load; llumlets drop a gateway's requests after 1.5 s without a heartbeat).
    gc.freeze()
    # uvicorn re-raises the signal it caught once it is done; these make that a no-op, so
    # SIGTERM does not kill the process before NATS is drained.
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    watcher = asyncio.create_task(_fail_requests_on_exit(server, service))
    try:
        log.info("gateway %s listening on http://%s:%d", config.gateway_id, config.host, config.port)
        await server.serve()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await service.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("gateway %s stopped", config.gateway_id)


def _ignore_signal(signum: int, frame: object) -> None:
    log.debug("signal %d after shutdown began: ignored", signum)


async def _fail_requests_on_exit(server: uvicorn.Server, service: GatewayService) -> None:
    """uvicorn waits for open responses before it stops; end them now instead of after minutes."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    service.fail_all("the gateway is shutting down")


def config_from_argv(argv: list[str] | None, prog: str = "python -m services.gateway") -> GatewayConfig:
    """The gateway's flags parsed (a bad one exits with the parser's message), NATS credentials
    exported, logging set up: what every way of starting a gateway does first."""
    parser = argparse.ArgumentParser(prog=prog, description="Corral's OpenAI-compatible gateway")
    add_arguments(parser)
    args = parser.parse_args(argv)
    nats_auth.export(args)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return config


def main(argv: list[str] | None = None) -> int:
    uvloop.run(serve(config_from_argv(argv)))
    return 0
