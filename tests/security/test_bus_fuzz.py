"""Every subject a Corral service subscribes to, fed malformed, truncated, oversized, wrong-schema,
deeply nested and hostile-valued MessagePack (seeded, bounded): no service dies or stalls, every
request/reply subject answers every message, each refusal is counted by subject, and the cluster
still serves an ordinary request afterwards."""

from __future__ import annotations

import asyncio
import math
import random
import time

import msgspec
import nats
from nats.errors import TimeoutError as NatsTimeoutError

from shared import subjects
from shared.messages import (
    AbortRequest, CommitNotice, DispatchRequest, DrainOrder, GatewayHeartbeat, GenerateRequest, HandoffQuery,
    KvCacheEvents, KvCacheSnapshot, LoadReport, MigrateOrder, MigrationAbort, MigrationCommit, PreAlloc,
    SamplingParams, SchedulerHeartbeat, TokenChunk, encode,
)
from tests.security.conftest import GATEWAY_ID, INSTANCES

SEED = 15
PER_SUBJECT = 40
_REQUEST = GenerateRequest("fuzz-r", [1, 2, 3], SamplingParams(max_tokens=2), subjects.gateway_output(GATEWAY_ID))
_REPORT = LoadReport("fuzz-i", 1, time.time(), 100, 50, 16, 0, 0, 0, 0, 0)
DST = INSTANCES[0]

# subject -> (a valid message of its type, is it request/reply, which services count refusals there)
SUBSCRIBED = {
    subjects.load_report("fuzz-i"): (_REPORT, False, ("gateway", "scheduler")),
    subjects.DISPATCH: (DispatchRequest("fuzz-d", 3, 4), True, ("scheduler",)),
    subjects.llumlet(DST, "generate"): (_REQUEST, True, (DST,)),
    subjects.llumlet(DST, "drain"): (DrainOrder(drain=False), True, (DST,)),
    subjects.llumlet(DST, "migrate"): (MigrateOrder("fuzz-p", INSTANCES[1], cancel=True), False, (DST,)),
    subjects.ABORT_ALL: (AbortRequest("fuzz-unknown"), False, INSTANCES),
    subjects.migration(DST, "prealloc"): (PreAlloc("fuzz-m", "fuzz-r", 1, 0.5, 0), True, (DST,)),
    subjects.migration(DST, "abort"): (MigrationAbort("fuzz-m"), True, (DST,)),
    subjects.migration(DST, "commit"): (MigrationCommit("fuzz-unknown", _REQUEST, [4], 3), True, (DST,)),
    subjects.migration(DST, "notice"): (CommitNotice("fuzz-m", 0.01), False, (DST,)),
    subjects.gateway_output(GATEWAY_ID): (TokenChunk("fuzz-unknown", DST, 0, [1]), False, ("gateway",)),
    subjects.kv_events("fuzz-i"): (KvCacheEvents("fuzz-i", 1, 16, [1, 2], [3]), False, ("scheduler",)),
    subjects.kv_snapshot("fuzz-i"): (KvCacheSnapshot("fuzz-i", 1, 16, [1, 2]), False, ("scheduler",)),
    subjects.HANDOFF: (HandoffQuery(DST, "fuzz-r", 1), True, ("scheduler",)),
    subjects.SCHEDULER_HEARTBEAT: (SchedulerHeartbeat("fuzz-s"), False, ("scheduler",)),
    subjects.gateway_heartbeat("fuzz-g"): (GatewayHeartbeat("fuzz-g", 0.25), False, INSTANCES),
}
# Not fed: a llumlet's `kv_snapshot` request subject, whose handler reads no payload (it publishes
# its snapshot whatever arrives), so there is nothing there to fuzz.
HOSTILE_VALUES = [-1, -(2**63), 2**64 - 1, 2**63 - 1, math.nan, math.inf, "bad id", "a.b", "", "\r\n", None,
                  [0] * 100_000, {"x": 1}, b"\x00" * 10]


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def payloads(valid: msgspec.Struct, rng: random.Random) -> list[bytes]:
    good = encode(valid)
    as_dict = msgspec.to_builtins(valid)
    fields = list(as_dict) if isinstance(as_dict, dict) else []
    out = [b"", b"\xc1", b"\xff" * 7, nested(100_000), b"\x81\xa1a" + nested(50_000), b"\xdf\xff\xff\xff\xff",
           b"\xdd\xff\xff\xff\xff" + b"\x00" * 10, msgspec.msgpack.encode(list(range(100_000))),
           bytes(rng.getrandbits(8) for _ in range(900_000))]  # oversized for its type, under NATS' 1 MiB
    out += [good[:cut] for cut in sorted(rng.sample(range(1, len(good)), min(6, len(good) - 1)))]  # truncated
    out += [encode(other) for other in (_REPORT, _REQUEST, DrainOrder(), AbortRequest("x")) if type(other) is not type(valid)]
    while len(out) < PER_SUBJECT:
        field = rng.choice(fields)
        out.append(msgspec.msgpack.encode({**as_dict, field: rng.choice(HOSTILE_VALUES)}))
    return out


def rejected_total(sec_cluster, service: str, pattern: str) -> float:
    return sec_cluster.metric(service, "corral:bus_rejected_messages_total", subject=pattern)


async def test_every_subscribed_subject_survives_fuzzing(sec_cluster):
    rng = random.Random(SEED)
    counted_before = {(svc, subjects.pattern_of(s)): rejected_total(sec_cluster, svc, subjects.pattern_of(s))
                      for s, (_, _, services) in SUBSCRIBED.items() for svc in services}
    unanswered: list[str] = []
    sent = 0
    nc = await nats.connect(sec_cluster.cluster.nats_url, max_reconnect_attempts=0)
    try:
        for subject, (valid, request_reply, _) in SUBSCRIBED.items():
            for payload in payloads(valid, rng):
                sent += 1
                if not request_reply:
                    await nc.publish(subject, payload)
                    continue
                try:
                    await nc.request(subject, payload, timeout=5)
                except NatsTimeoutError:
                    unanswered.append(f"{subject}: {payload[:40]!r}")
            await nc.flush()
    finally:
        await nc.close()
    assert sent == PER_SUBJECT * len(SUBSCRIBED)
    assert not unanswered, unanswered
    await asyncio.sleep(1.0)
    sec_cluster.assert_all_alive()
    for (service, pattern), before in counted_before.items():
        assert rejected_total(sec_cluster, service, pattern) > before, (service, pattern)
    assert sec_cluster.chat().status_code == 200
