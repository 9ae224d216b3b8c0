"""Corral's gateway: the OpenAI-compatible HTTP API in front of the instances.

For the CLI: `add_arguments(parser)`, `config_from_args(args)`, then `await serve(config)`
(or `main(argv)`, which does all three under uvloop).
"""

from services.gateway.config import ConfigError, GatewayConfig, add_arguments, config_from_args, config_from_env

__all__ = ["ConfigError", "GatewayConfig", "add_arguments", "config_from_args", "config_from_env", "main", "serve"]


def __getattr__(name: str):  # serve/main pull in uvicorn and starlette: import them on first use
    if name in ("serve", "main"):
        from services.gateway import server

        return getattr(server, name)
    raise AttributeError(name)
