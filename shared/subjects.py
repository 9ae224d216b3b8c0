"""NATS subject names, built here and nowhere else.

Layout: `corral.<role>.<id>.<verb>`. Instance and gateway ids are restricted to NATS-safe tokens
(see `valid_token`), so a subject can never be split or wildcarded by an id.
"""

from __future__ import annotations

import re

PREFIX = "corral"

_TOKEN = re.compile(r"[A-Za-z0-9_\-]+")


def valid_token(value: str) -> str:
    if not _TOKEN.fullmatch(value):  # (not `^...$`: `$` also matches before a trailing newline)
        raise ValueError(f"{value!r} is not a valid subject token (letters, digits, '_' and '-')")
    return value


# Load reports: every llumlet publishes on its own subject; schedulers and gateways subscribe to all.
def load_report(instance_id: str) -> str:
    return f"{PREFIX}.load.{valid_token(instance_id)}"


LOAD_REPORTS_ALL = f"{PREFIX}.load.*"

# Dispatch decisions: request/reply to the global scheduler (a queue group, so replicas share it).
DISPATCH = f"{PREFIX}.scheduler.dispatch"
SCHEDULER_QUEUE = "corral-scheduler"

# Prefill/decode hand-offs: a prefill llumlet asks (request/reply, the same queue group) where a
# request that produced its first token decodes.
HANDOFF = f"{PREFIX}.scheduler.handoff"


def llumlet(instance_id: str, verb: str) -> str:
    """Orders to one llumlet: generate, abort, migrate, drain, shutdown."""
    return f"{PREFIX}.llumlet.{valid_token(instance_id)}.{verb}"


# Aborts are broadcast: after a migration the gateway may not yet know which instance holds the
# request (or one may hold a reservation for it), and every llumlet drops what it has of it.
ABORT_ALL = f"{PREFIX}.abort"


def migration(instance_id: str, verb: str) -> str:
    """Migration handshake addressed to a destination llumlet: prealloc, abort, commit, notice."""
    return f"{PREFIX}.migration.{valid_token(instance_id)}.{verb}"


def gateway_output(gateway_id: str) -> str:
    """Token stream into one gateway; it demultiplexes by request id."""
    return f"{PREFIX}.gateway.{valid_token(gateway_id)}.out"


def gateway_heartbeat(gateway_id: str) -> str:
    """A gateway's heartbeat (llumlets watch every gateway's)."""
    return f"{PREFIX}.gateway.{valid_token(gateway_id)}.alive"


GATEWAY_HEARTBEATS_ALL = f"{PREFIX}.gateway.*.alive"

# Scheduler replicas' heartbeats: the leader of migration pairing is chosen from them.
SCHEDULER_HEARTBEAT = f"{PREFIX}.scheduler.heartbeat"


# Prefix caches: each llumlet's KV events and snapshots (shared.messages.KvCacheEvents /
# KvCacheSnapshot); the schedulers take both with one subscription (`KV_ALL`: one instance's
# messages stay in order) and ask one for a snapshot on `llumlet(id, "kv_snapshot")`.
def kv_events(instance_id: str) -> str:
    return f"{PREFIX}.kv.{valid_token(instance_id)}.events"


def kv_snapshot(instance_id: str) -> str:
    return f"{PREFIX}.kv.{valid_token(instance_id)}.snapshot"


KV_ALL = f"{PREFIX}.kv.*.*"


# Autoscaler events (scale decisions, drains) for observers and tests.
SCALING_EVENTS = f"{PREFIX}.scaling.events"


_PER_ID = {"load": 3, "llumlet": 4, "migration": 4, "gateway": 4, "kv": 4}  # role -> tokens in its subjects
_FIXED = {DISPATCH, HANDOFF, ABORT_ALL, SCALING_EVENTS, SCHEDULER_HEARTBEAT}


def pattern_of(subject: str) -> str:
    """The subject with its instance or gateway id replaced by `*` (a bounded metric label): what
    a service subscribed to, not who it was addressed to. Anything else is `other`."""
    if subject in _FIXED:
        return subject
    parts = subject.split(".")
    if len(parts) >= 3 and parts[0] == PREFIX and _PER_ID.get(parts[1]) == len(parts):
        verb = parts[3:]
        if all(_TOKEN.fullmatch(token) and len(token) <= 16 for token in verb):
            return ".".join([PREFIX, parts[1], "*", *verb])
    return "other"
