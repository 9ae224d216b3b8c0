"""One log format for every service process."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str) -> None:
    level = os.environ.get("CORRAL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
    if level != "DEBUG":  # the chattiest libraries only speak up about problems
        for noisy in ("nats", "uvicorn.access", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
