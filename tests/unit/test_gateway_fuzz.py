"""Schemathesis against the gateway's own /openapi.json (instances scripted, no NATS): no input
the schema allows or forbids makes a 5xx, and every answer matches its documented schema.

Two checks are left out on purpose: a schema-valid body may still be a 400 when it does not fit
the live context (the limit is the instances', not the schema's), and /ready is a 503 by design
while no instance is live.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error, positive_data_acceptance  # noqa: E402

from services.gateway.app import create_app  # noqa: E402
from services.gateway.config import GatewayConfig  # noqa: E402
from services.gateway.tokenizer import ModelTokenizer  # noqa: E402
from tests.unit.test_gateway_sse import ScriptedGateway, chunks_for  # noqa: E402

pytestmark = pytest.mark.slow


def _app():
    """Built at collection: schemathesis parametrizes from the schema (a scripted gateway, no NATS)."""
    from services.tools.make_model import build_tokenizer

    home = tempfile.mkdtemp(prefix="corral-fuzz-")
    atexit.register(shutil.rmtree, home, True)
    path = Path(home) / "tiny-tok"
    build_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    config = GatewayConfig(model_dir=str(path), gateway_id="gw-fuzz", request_inactivity_timeout_s=0.5)
    gateway = ScriptedGateway(config, ModelTokenizer.load(str(path)))
    gateway.script = chunks_for([40, 41, 42])
    return create_app(gateway)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_holds_to_its_schema(case):
    excluded = [positive_data_acceptance] + ([not_a_server_error] if case.path == "/ready" else [])
    case.call_and_validate(excluded_checks=excluded)
