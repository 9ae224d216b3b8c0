"""NATS authenticated and authorised (issue 15, point 3): the role table of `shared.nats_auth`
under a real nats-server, the services running under it, and TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import time

import httpx
import nats
import pytest
from nats.errors import Error as NatsError

from shared import nats_auth, subjects
from shared.embedded_nats import start_nats
from shared.messages import MigrateOrder, encode
from tests.support.cluster import Cluster


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    auth = nats_auth.EmbeddedAuth.create()
    server = start_nats(config=auth.config)
    yield server, auth
    server.stop()
    auth.remove()


async def _connect(server, auth, role: str, errors: list | None = None):
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(server.url, error_cb=on_error, allow_reconnect=False,
                              **nats_auth.read_credentials(str(auth.paths[role])))


async def test_anonymous_and_wrong_password_clients_are_refused(secured):
    server, auth = secured
    with pytest.raises(NatsError, match="Authorization Violation"):
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0)
    with pytest.raises(NatsError, match="Authorization Violation"):
        await nats.connect(server.url, user="llumlet", password="guess", allow_reconnect=False, max_reconnect_attempts=0)


async def _delivered(server, auth, publisher_role: str, subject: str, listener_role: str, listen_on: str) -> tuple[bool, list]:
    errors: list[str] = []
    listener = await _connect(server, auth, listener_role)
    publisher = await _connect(server, auth, publisher_role, errors)
    got: list[str] = []

    async def on_msg(msg) -> None:
        got.append(msg.subject)

    try:
        await listener.subscribe(listen_on, cb=on_msg)
        await listener.flush()
        # Core NATS delivers at most once, and a run here lost one allowed message in a few hundred
        # with no error: publish again until a delivery or a refusal ends it, not once.
        deadline = time.monotonic() + 5.0
        while not got and not errors and time.monotonic() < deadline:
            await publisher.publish(subject, b"\x80")
            await publisher.flush()
            await listener.flush()
            for _ in range(10):
                if got or errors:
                    break
                await asyncio.sleep(0.05)
    finally:
        await publisher.close()
        await listener.close()
    return bool(got), errors


@pytest.mark.parametrize("role, subject, listener, pattern, allowed", [
    ("llumlet", subjects.llumlet("victim", "migrate"), "llumlet", "corral.llumlet.*.migrate", False),
    ("scheduler", subjects.llumlet("victim", "migrate"), "llumlet", "corral.llumlet.*.migrate", True),
    ("gateway", subjects.load_report("forged"), "scheduler", subjects.LOAD_REPORTS_ALL, False),
    ("llumlet", subjects.load_report("real"), "scheduler", subjects.LOAD_REPORTS_ALL, True),
    ("gateway", subjects.gateway_output("gw"), "gateway", "corral.gateway.*.out", False),  # forged tokens
    ("llumlet", subjects.llumlet("victim", "generate"), "llumlet", "corral.llumlet.*.generate", False),
    ("autoscaler", subjects.llumlet("victim", "generate"), "llumlet", "corral.llumlet.*.generate", False),
    ("gateway", subjects.llumlet("victim", "drain"), "llumlet", "corral.llumlet.*.drain", False),
    ("admin", subjects.llumlet("victim", "drain"), "llumlet", "corral.llumlet.*.drain", True),
    ("scheduler", subjects.ABORT_ALL, "llumlet", subjects.ABORT_ALL, False),
    ("llumlet", subjects.HANDOFF, "scheduler", subjects.HANDOFF, True),  # a prefill instance asks where to hand off
    ("gateway", subjects.HANDOFF, "scheduler", subjects.HANDOFF, False),
])
async def test_each_role_publishes_only_its_own_subjects(secured, role, subject, listener, pattern, allowed):
    server, auth = secured
    delivered, errors = await _delivered(server, auth, role, subject, listener, pattern)
    assert delivered == allowed, (role, subject, errors)
    if not allowed:
        assert any("permissions violation" in e.lower() for e in errors), errors


async def test_a_gateway_cannot_read_other_subjects(secured):
    server, auth = secured
    errors: list[str] = []
    gateway = await _connect(server, auth, "gateway", errors)
    try:
        await gateway.subscribe(subjects.migration("victim", "commit"))  # a request's whole state
        await gateway.flush()
        await asyncio.sleep(0.2)
    finally:
        await gateway.close()
    assert any("permissions violation" in e.lower() for e in errors), errors


def test_corral_services_serve_under_their_roles(secured, tiny_model_dir, tmp_path):
    """The whole request path (dispatch, generate, tokens, load reports) under the role table."""
    server, auth = secured
    cluster = Cluster(server.url, tiny_model_dir, tmp_path)
    creds = {role: ("--nats-creds", str(path)) for role, path in auth.paths.items()}
    cluster.start_scheduler(*creds["scheduler"])
    cluster.start_llumlet("auth-0", "--sim-time-scale", "0.1", *creds["llumlet"])
    cluster.start_gateway(*creds["gateway"])
    try:
        cluster.wait_ready(instances=1)
        reply = httpx.post(f"{cluster.base_url}/v1/completions", timeout=60,
                           json={"model": "tiny-llama", "prompt": "Once", "max_tokens": 5})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        for proc in cluster.procs.values():
            assert "permissions violation" not in proc.log().lower(), proc.log()[-2000:]
    finally:
        cluster.stop()


def _self_signed(tmp_path):
    x509 = pytest.importorskip("cryptography.x509", reason="the cryptography package makes the test certificate")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_tls_by_flag(tmp_path):
    cert, key = _self_signed(tmp_path)
    credentials = nats_auth.new_credentials()
    config = tmp_path / "nats.conf"
    config.write_text(nats_auth.server_config(credentials, tls_cert=cert, tls_key=key))
    server = start_nats(config=config)
    creds_file = tmp_path / "scheduler.creds"
    creds_file.write_text(credentials["scheduler"].line())
    try:
        options = nats_auth.client_options({nats_auth.ENV_CREDS: str(creds_file), nats_auth.ENV_TLS_CA: cert})
        assert "tls" in options
        nc = await nats.connect(f"tls://127.0.0.1:{server.port}", allow_reconnect=False, **options)
        started = time.monotonic()
        await nc.publish(subjects.llumlet("x", "migrate"), encode(MigrateOrder("p", "y")))
        await nc.flush()
        assert time.monotonic() - started < 5
        await nc.close()
        plain = nats_auth.client_options({nats_auth.ENV_CREDS: str(creds_file)})
        with pytest.raises(Exception):  # the server requires TLS: a plain client gets nowhere
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **plain)
    finally:
        server.stop()




async def test_a_deployments_credentials_are_made_once_and_work(tmp_path):
    """What docker compose's `credentials` service makes (python -m shared.nats_auth DIR)."""
    from services.llumlet.migration import kv_auth

    assert nats_auth.write_deployment(tmp_path)
    config = (tmp_path / nats_auth.SERVER_CONFIG_FILE).read_text()
    assert not nats_auth.write_deployment(tmp_path)  # a restart keeps them
    assert (tmp_path / nats_auth.SERVER_CONFIG_FILE).read_text() == config
    assert all((tmp_path / f"{role}.creds").stat().st_mode & 0o077 == 0 for role in nats_auth.ROLES)
    secret = kv_auth.deployment_secret({kv_auth.ENV_SECRET_FILE: str(tmp_path / nats_auth.KV_SECRET_FILE)})
    assert secret and len(secret) >= 32
    server = start_nats(config=tmp_path / nats_auth.SERVER_CONFIG_FILE)
    try:
        nc = await nats.connect(server.url, allow_reconnect=False,
                                **nats_auth.read_credentials(str(tmp_path / "llumlet.creds")))
        await nc.close()
    finally:
        server.stop()
