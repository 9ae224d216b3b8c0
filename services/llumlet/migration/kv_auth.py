"""Who may write into a llumlet's KV receiver: peers that hold the deployment's KV secret.

Before any frame, the receiver sends a fresh random nonce and the sender answers with
HMAC-SHA256(secret, label | nonce); anything else (a wrong proof, a frame header, silence past
the handshake timeout) closes the connection before a byte is parsed as a frame, let alone
reaches a block, and is counted in `corral:kv_rejected_connections_total{reason}`. A proof is
good for that one connection only (the nonce is new each time), and the secret never crosses the
wire. Authenticated peers still write only into leases this llumlet granted over NATS (the
sink's `admit`: unknown migration, wrong range or size are refused per frame).

    challenge = "CKH1" | nonce 32 B            (receiver → sender, on accept)
    proof     = "CKH1" | HMAC-SHA256 32 B      (sender → receiver)

The secret comes from CORRAL_KV_SECRET (the value) or CORRAL_KV_SECRET_FILE (a file holding it);
`corral up` makes one per run. Without one, the data plane is unauthenticated (as before) and the
llumlet says so at start: then only a network boundary (deploy/'s NetworkPolicy) protects it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from shared.bus_guard import RateLimitedLog

MAGIC = b"CKH1"
NONCE_SIZE = 32
MESSAGE_SIZE = len(MAGIC) + 32  # a challenge and a proof are the same size
_LABEL = b"corral-kv-v1"
ENV_SECRET, ENV_SECRET_FILE = "CORRAL_KV_SECRET", "CORRAL_KV_SECRET_FILE"

KV_REJECTED = Counter("corral:kv_rejected_connections", "KV data plane connections refused before any frame, by reason",
                      ["reason"], registry=None)
_log_limit = RateLimitedLog()


def register(registry: CollectorRegistry) -> None:
    try:
        registry.register(KV_REJECTED)
    except ValueError:
        pass


def deployment_secret(environ: os._Environ | dict[str, str] = os.environ) -> bytes | None:
    """The KV secret this process was given, or None (unauthenticated data plane)."""
    value = environ.get(ENV_SECRET)
    if not value and environ.get(ENV_SECRET_FILE):
        value = Path(environ[ENV_SECRET_FILE]).read_text().strip()
    return value.encode() if value else None


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def challenge() -> tuple[bytes, bytes]:
    """(nonce, the message that carries it)."""
    nonce = secrets.token_bytes(NONCE_SIZE)
    return nonce, MAGIC + nonce


def nonce_of(message: bytes | memoryview) -> bytes:
    message = bytes(message)
    if len(message) != MESSAGE_SIZE or message[:4] != MAGIC:
        raise ValueError("not a KV challenge: is the receiver configured without the KV secret?")
    return message[4:]


def proof(secret: bytes, nonce: bytes) -> bytes:
    return MAGIC + hmac.new(secret, _LABEL + nonce, hashlib.sha256).digest()


def verify(secret: bytes, nonce: bytes, message: bytes | memoryview) -> bool:
    return hmac.compare_digest(bytes(message), proof(secret, nonce))


def rejected(reason: str, peer: object, log: logging.Logger) -> None:
    KV_REJECTED.labels(reason=reason).inc()
    _log_limit.warning(log, reason, "KV connection from %s refused (%s): closed before any frame", peer, reason)


def rejected_count(reason: str | None = None) -> float:
    total = 0.0
    for metric in KV_REJECTED.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and (reason is None or sample.labels.get("reason") == reason):
                total += sample.value
    return total
