"""Live migration micro-benchmark on the simulated engine (Llumnix §6.2 / Figure 10).

    .venv/bin/python -m benchmarks.migration_sim [--lengths 256,512,1024,2048,4096,8192]
        [--kv-bytes-per-token 32768] [--repeats 4] [--out results/migration_sim.json]

Two llumlets over a private nats-server: the source in this process (its engine's steps are
timed), the destination a separate `corral llumlet` process (as in production: its own event
loop, its own KV receiver). Both run simulated A10 steps at time scale 1 (real modelled time),
each with a background batch that keeps decoding. For each sequence length one request is
migrated live, another by a blocking copy (stage limit 1: stop, copy everything, resume), and
recompute is measured as the time to first token of the whole sequence as a new request on an
engine with the same batch (prefill + queueing). Data plane throughput (stage 0 of the longest
sequence) is compared with a raw loopback TCP copy of the same bytes, measured like for like in
the same run: one copy right before and one right after each migration, from the same event loop
(the source's, its engine stepping) to a receiver process that lives for the whole run, both
buffers warm. Each migration's ratio is against the mean of its two raw copies (median, min and
max over the repeats; also against the better of the two). A best-of-N raw figure against single
transfers would compare the luckiest raw copy with a typical transfer.

Downtime = time out of the batch: suspend on the source → commit acknowledged (the request is in
the destination's running batch). "One decode step" = the modelled A10 step of the source's batch
at the moment of migration (time scale 1), i.e. what a real GPU would spend on one iteration.
Client stall = what the client sees (Llumnix's downtime, ending at the client): the gap in the
request's token stream, as the gateway orders it (`services.gateway.streams`), between the last new
token from the source and the first new token from the destination; beside it, the request's own
median gap between new tokens in the same run (the stall's ideal is one of those). Arrivals are
stamped by a client process of its own (`record_client`: not this one, whose event loop and GIL the
source llumlet shares). Where the stall goes, phase by phase (`HANDOVER_PHASES`), lines up on one
clock (monotonic, shared by the processes of a host): the source's record (its last step's end,
suspend, last stage out), the destination's handover log line (commit, in its engine, the step that
computed the request's first token there: `services/llumlet/migration/handover.py`), and the
client's arrivals.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable
from pathlib import Path

import nats
import uvloop

from services.gateway.streams import HandoverClock, TokenOrderer
from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine, SimEngineConfig
from shared.engine_model.config import SchedulerConfig
from services.llumlet.migration.handover import parse_handovers
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from services.llumlet.service import Llumlet
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import (
    AbortRequest,
    GenerateRequest,
    LoadReport,
    SamplingParams,
    TokenChunk,
    decode,
    encode,
)

REPO = Path(__file__).resolve().parents[1]
SRC, DST = "bench-src", "bench-dst"
BACKGROUND_PROMPT = 1024  # four of these decode on each instance throughout
BACKGROUND_REQUESTS = 4
MIN_OUTPUT_BEFORE = 16  # decode steps with the request in the batch before migrating it
OUTPUT_SUBJECT = "bench.out"


@dataclasses.dataclass
class Settings:
    limits: MigrationLimits
    lengths: list[int]
    kv_bytes_per_token: int
    repeats: int
    num_blocks: int
    block_size: int
    max_model_len: int
    gpu: str
    out: Path


# ---------------------------------------------------------------------------------------------
# Instrumentation
# ---------------------------------------------------------------------------------------------


class TimedSimEngine(SimEngine):
    """A SimEngine that logs its pure decode steps: (start, wall seconds, modelled seconds)."""

    def __init__(self, config: SimEngineConfig) -> None:
        super().__init__(config)
        self.steps: list[tuple[float, float, float]] = []
        self._modelled = 0.0
        step_time_of = self.latency.step_time_of

        def recorded(out) -> float:
            modelled = step_time_of(out)
            self._modelled = modelled if out.prefill_tokens == 0 else 0.0  # (prefill steps differ)
            return modelled

        self.latency.step_time_of = recorded

    async def step(self):
        started, self._modelled = time.monotonic(), 0.0
        outputs = await super().step()
        if self._modelled:
            self.steps.append((started, time.monotonic() - started, self._modelled))
        return outputs


class Chunks:
    """Arrival time and publisher of every token chunk, per request; and each request's stream as
    the gateway orders it: when new tokens reached the client, and each migration's stall."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[tuple[float, TokenChunk]]] = defaultdict(list)
        self._orderers: dict[str, TokenOrderer] = defaultdict(TokenOrderer)
        self._clocks: dict[str, HandoverClock] = defaultdict(HandoverClock)
        self.deliveries: dict[str, list[float]] = defaultdict(list)  # when new tokens reached the client
        self.gaps: dict[str, list[float]] = defaultdict(list)  # between them, but at a migration
        self.stalls: dict[str, list[float]] = defaultdict(list)  # at each migration (seconds)
        # At each migration: when the last new token from the source and the first from the
        # destination reached the client (monotonic seconds).
        self.handovers: dict[str, list[tuple[float, float]]] = defaultdict(list)

    async def on_chunk(self, msg) -> None:
        """A chunk relayed by the client recorder (`record_client`), with its arrival time there."""
        (now,) = _STAMP.unpack_from(msg.data)
        chunk = decode(msg.data[_STAMP.size:], TokenChunk)
        rid = chunk.request_id
        self.by_request[rid].append((now, chunk))
        if any(d.token_ids for d in self._orderers[rid].accept(chunk)):  # (as `OutputStream.feed`)
            stall = self._clocks[rid].delivered(chunk.instance_id, now)
            if stall is not None:
                self.stalls[rid].append(stall)
                self.handovers[rid].append((now - stall, now))
            elif self.deliveries[rid]:
                self.gaps[rid].append(now - self.deliveries[rid][-1])
            self.deliveries[rid].append(now)

    def client_view(self, request_id: str) -> dict:
        """The first migration's stall, and the request's median gap between new tokens apart
        from its stalls (ms); when its tokens reached the client on either side (monotonic s)."""
        src_token_at, dst_token_at = self.handovers[request_id][0]
        return {"client_stall_ms": 1e3 * self.stalls[request_id][0],
                "own_itl_ms": 1e3 * statistics.median(self.gaps[request_id]),
                "src_token_at_client": src_token_at, "dst_token_at_client": dst_token_at}

    def count_from(self, request_id: str, instance_id: str) -> int:
        return sum(len(c.token_ids) for _, c in self.by_request[request_id] if c.instance_id == instance_id)

    def token_times(self, request_id: str, instance_id: str) -> list[float]:
        return [t for t, c in self.by_request[request_id] if c.instance_id == instance_id and c.token_ids]


_STAMP = struct.Struct("!d")  # the client recorder's arrival time (monotonic s) before each relayed chunk
_RELAY = ".recorded"  # suffix of the subject the recorder relays a subject's chunks on

_RECORDER = """
import asyncio, sys, time, struct, nats, uvloop
async def main(url, subject):
    nc = await nats.connect(url)
    stamp = struct.Struct("!d")
    async def on(msg):
        await nc.publish(subject + "{relay}", stamp.pack(time.monotonic()) + msg.data)
    await nc.subscribe(subject, cb=on)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main(sys.argv[1], sys.argv[2]))
""".format(relay=_RELAY)


async def record_client(nc, nats_url: str, subject: str, chunks: Chunks) -> subprocess.Popen:
    """The client, in a process of its own (as the gateway is): it stamps when each chunk on
    `subject` arrived and relays it to `chunks`. Stamped here, arrivals would wait for this
    process's event loop and GIL, which the source llumlet (and its engine thread) share."""
    await nc.subscribe(subject + _RELAY, cb=chunks.on_chunk)
    proc = subprocess.Popen([sys.executable, "-c", _RECORDER, nats_url, subject], stdout=subprocess.PIPE)
    line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
    if line.strip() != b"ready":
        proc.kill()
        raise RuntimeError("the client recorder did not start")
    return proc


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------------------------------------
# Raw loopback baseline: the same bytes to a plain receiver process, no framing, no fusion
# ---------------------------------------------------------------------------------------------


_SIZE = struct.Struct("!Q")  # each raw copy is announced by its length (the same receivers serve any size)


def _raw_receiver(conn) -> None:
    """Reads copies (length, then the bytes) into a touched buffer and answers each with one
    byte, for as long as the sender goes on."""
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    buf = memoryview(bytearray())
    while True:
        size = bytearray(_SIZE.size)
        if not _recv_into_exactly(peer, memoryview(size)):
            return
        (nbytes,) = _SIZE.unpack(size)
        if len(buf) < nbytes:
            buf = memoryview(bytearray(b"\x01" * nbytes))  # touched: the destination's KV pool is warm too
        if not _recv_into_exactly(peer, buf[:nbytes]):
            return
        peer.sendall(b"k")


def _recv_into_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class RawLoopback:
    """A raw loopback TCP copy of `nbytes`, measured the way a stage is: one copy at a time, sent
    from this process's event loop (the source llumlet's, its engine stepping beside it) to a
    receiver that lives for the whole run (as the destination llumlet's KV receiver does), both
    buffers warm. No framing, no checksum, no acks but the one at the end (and an 8-byte length
    before the bytes)."""

    def __init__(self, nbytes: int, port: int | None = None) -> None:
        self.nbytes, self.port = nbytes, port  # a port: a receiver that runs already (else one is started)
        self._proc: multiprocessing.Process | None = None
        self._sock: socket.socket | None = None
        self._payload = memoryview(bytearray(b"\x5a" * nbytes))

    async def start(self) -> None:
        port = self.port
        if port is None:
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            self._proc = ctx.Process(target=_raw_receiver, args=(child,), daemon=True)
            self._proc.start()
            port = await asyncio.to_thread(parent.recv)
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)
        await self.copy()  # the receiver's first copy is not measured (its buffer and socket ramp up)

    async def copy(self) -> float:
        """GB/s of one copy (until the receiver's answer)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        await loop.sock_sendall(self._sock, _SIZE.pack(self.nbytes))
        await loop.sock_sendall(self._sock, self._payload)
        if await loop.sock_recv(self._sock, 1) != b"k":
            raise RuntimeError("raw loopback receiver went away")
        return self.nbytes / (time.monotonic() - started) / 1e9

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._proc is not None:
            self._proc.join(5)


async def raw_links(nbytes: int, destination_port: int) -> dict[str, RawLoopback]:
    """Raw copies into the destination llumlet (its event loop, beside its engine: the KV
    receiver's conditions; the like-for-like baseline) and into a receiver process of its own
    (an idle one), started and warmed up."""
    links = {"in_destination": RawLoopback(nbytes, destination_port), "own_process": RawLoopback(nbytes)}
    for link in links.values():
        await link.start()
    return links


async def beside_raw_copies(links: dict[str, RawLoopback], migrate: Awaitable[dict]) -> dict:
    """Run one migration with a raw copy over each link right before and right after it (the
    same machine load, the same sender loop); its row gets `raw_loopback_gbps`: {link: [before,
    after]}."""
    before = {name: await link.copy() for name, link in links.items()}
    row = await migrate
    after = {name: await links[name].copy() for name in reversed(links)}
    row["raw_loopback_gbps"] = {name: [before[name], after[name]] for name in links}
    return row


def transfer_vs_raw(rows: list[dict]) -> dict:
    """Per link, each transfer (`first_stage_gbps`) against the raw copies right before and
    after it (their mean; the better of the two is the stricter reading): median, min, max."""
    def against(name: str) -> dict:
        ratios = [(r["first_stage_gbps"] or 0) / statistics.fmean(r["raw_loopback_gbps"][name]) for r in rows]
        strict = [(r["first_stage_gbps"] or 0) / max(r["raw_loopback_gbps"][name]) for r in rows]
        copies = [gbps for r in rows for gbps in r["raw_loopback_gbps"][name]]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "runs": ratios,
                "strict_median": statistics.median(strict),
                "raw_gbps": {"median": statistics.median(copies), "min": min(copies), "max": max(copies)}}

    return {name: against(name) for name in rows[0]["raw_loopback_gbps"]}


def print_transfer_vs_raw(ratios: dict) -> None:
    for name, ratio in ratios.items():
        raw = ratio["raw_gbps"]
        print(f"raw loopback into {name.replace('_', ' ')}: single copies median {raw['median']:.2f} "
              f"[{raw['min']:.2f}-{raw['max']:.2f}] GB/s; transfer over it, per migration: median "
              f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}] (against the better of its two raw "
              f"copies: {ratio['strict_median']:.2f})")


class _RawSink(asyncio.BufferedProtocol):
    """The raw receiver inside the destination llumlet: reads copies (length, then the bytes)
    into a warm buffer on the llumlet's own event loop (beside its engine, as the KV receiver
    is) and answers each with one byte. No framing, no checksum."""

    def __init__(self) -> None:
        self.size = bytearray(_SIZE.size)
        self.buffer = memoryview(bytearray())
        self.target = memoryview(self.size)
        self.got = 0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.target[self.got :]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got < len(self.target):
            return
        self.got = 0
        if self.target.obj is self.size:
            (nbytes,) = _SIZE.unpack(self.size)
            if len(self.buffer) < nbytes:
                self.buffer = memoryview(bytearray(b"\x01" * nbytes))  # touched, as the KV pool is
            self.target = self.buffer[:nbytes]
        else:
            self.target = memoryview(self.size)
            self.transport.write(b"k")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


class _DestinationWithRawSink:
    """The destination llumlet, plus a raw loopback receiver on its event loop (its port is
    written to `port_file`)."""

    def __init__(self, llumlet, port_file: Path) -> None:
        self.llumlet, self.port_file = llumlet, port_file
        self.server = None

    async def start(self) -> None:
        await self.llumlet.start()
        pool = getattr(self.llumlet.engine, "kv_pool", None)
        if pool is not None:  # the simulated engine's lazily mapped pool: touch it, as the source's (`warm_up`)
            resident = _rss_bytes()
            pool.data.fill(0)
            print(f"destination KV pool touched: RSS {resident / 2**20:.0f} -> {_rss_bytes() / 2**20:.0f} MiB", flush=True)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(_RawSink, "127.0.0.1", 0)
        self.port_file.write_text(str(self.server.sockets[0].getsockname()[1]))

    async def stop(self) -> None:
        self.server.close()
        await self.llumlet.stop()


def serve_destination(argv: list[str]) -> None:
    """`corral llumlet ARGV[1:]` (the same config, engine and runner) with a raw receiver beside
    it: argv[0] is the file that gets the raw receiver's port."""
    from services.cli import build_parser
    from services.llumlet.config import config_from_args
    from services.llumlet.engines import create_engine
    from services.runner import run, serve_until_signalled
    from shared.logs import setup_logging

    setup_logging("llumlet")  # as `corral llumlet` (migration_vllm reads the destination's timing lines)
    port_file = Path(argv[0])
    config = config_from_args(build_parser().parse_args(["llumlet", *argv[1:]]))
    llumlet = Llumlet(config, create_engine(config))
    run(serve_until_signalled(_DestinationWithRawSink(llumlet, port_file), wait=llumlet.wait_failed))


def launch_destination(llumlet_args: list[str], port_file: Path, log_path: Path,
                       env: dict[str, str] | None = None) -> subprocess.Popen:
    """A `corral llumlet LLUMLET_ARGS` process with a raw loopback receiver on its event loop
    (`serve_destination`); `raw_port` reads that receiver's port once it is up."""
    port_file.unlink(missing_ok=True)
    launcher = "import sys; from benchmarks.migration_sim import serve_destination; serve_destination(sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", launcher, str(port_file), *llumlet_args], cwd=REPO,
                            stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)


def raw_port(port_file: Path) -> int:
    return int(port_file.read_text())


# ---------------------------------------------------------------------------------------------
# The two instances
# ---------------------------------------------------------------------------------------------


def engine_config(s: Settings, kv_bytes_per_token: int) -> SimEngineConfig:
    scheduler = SchedulerConfig(num_blocks=s.num_blocks, block_size=s.block_size, max_model_len=s.max_model_len)
    return SimEngineConfig(scheduler, gpu=s.gpu, time_scale=1.0, kv_bytes_per_token=kv_bytes_per_token)


def start_destination(s: Settings, nats_url: str, log_path: Path, port_file: Path) -> subprocess.Popen:
    """`corral llumlet` (sim engine) with a raw loopback receiver on its event loop."""
    return launch_destination(["--nats-url", nats_url, "--instance-id", DST,
                               "--engine", "sim", "--sim-num-blocks", str(s.num_blocks),
                               "--sim-block-size", str(s.block_size), "--max-model-len", str(s.max_model_len),
                               "--sim-gpu", s.gpu, "--sim-time-scale", "1",
                               "--sim-kv-bytes-per-token", str(s.kv_bytes_per_token)], port_file, log_path)


async def wait_for_destination(nc, timeout_s: float = 60.0) -> LoadReport:
    seen: list[LoadReport] = []

    async def on_report(msg) -> None:
        seen.append(decode(msg.data, LoadReport))

    sub = await nc.subscribe(subjects.load_report(DST), cb=on_report)
    await wait_until(lambda: any(r.kv_address for r in seen), timeout_s, "the destination llumlet")
    await sub.unsubscribe()
    return seen[-1]


def request(request_id: str, prompt_len: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), OUTPUT_SUBJECT)


async def submit(nc, instance_id: str, req: GenerateRequest) -> None:
    reply = await nc.request(subjects.llumlet(instance_id, "generate"), encode(req), timeout=10)
    assert b"error" not in reply.data, reply.data


# ---------------------------------------------------------------------------------------------
# One migration
# ---------------------------------------------------------------------------------------------


def step_stats(steps: list[tuple[float, float, float]], start: float, end: float) -> dict:
    window = [(wall, modelled) for t, wall, modelled in steps if start <= t and t + wall <= end]
    if not window:
        return {"steps": 0}
    walls, modelled = [w for w, _ in window], [m for _, m in window]
    return {"steps": len(window), "mean_wall_ms": 1e3 * statistics.fmean(walls),
            "mean_modelled_ms": 1e3 * statistics.fmean(modelled),
            "mean_overhead_ms": 1e3 * statistics.fmean(w - m for w, m in window)}


async def migrate_once(src: Llumlet, nc, chunks: Chunks, length: int, stage_limit: int | None, tag: str) -> dict:
    rid = f"{tag}-{length}-{time.monotonic_ns()}"
    await submit(nc, SRC, request(rid, length, 4000))
    await wait_until(lambda: chunks.count_from(rid, SRC) >= MIN_OUTPUT_BEFORE, 120, f"{rid} decoding")
    coordinator = src.migration.coordinator
    limits = coordinator.limits
    if stage_limit is not None:
        coordinator.limits = dataclasses.replace(limits, stage_limit=stage_limit)
    modelled_step = src.engine.steps[-1][2]
    try:
        m = await coordinator.migrate(rid, DST)
    finally:
        coordinator.limits = limits
    if m is None or m.status is not MigrationStatus.FINISHED:
        raise RuntimeError(f"migration of {rid} failed: {m and m.reason}")
    await wait_until(lambda: chunks.stalls[rid] and len(chunks.deliveries[rid]) >= MIN_OUTPUT_BEFORE + 8, 30,
                     f"{rid}'s first tokens on the destination")
    await nc.publish(subjects.ABORT_ALL, encode(AbortRequest(rid, "benchmark done")))
    src_times = chunks.token_times(rid, SRC)
    duration = m.ended_at - m.started_at
    client = chunks.client_view(rid)
    return {
        "length": length,
        "request_id": rid,
        "downtime_ms": 1e3 * m.downtime_s,
        **client,
        "handover": source_stamps(m, src.engine.steps, client),
        "modelled_decode_step_ms": 1e3 * modelled_step,
        "stages": [dataclasses.asdict(stage) for stage in m.stages],
        "num_stages": len(m.stages),
        "migration_ms": 1e3 * duration,
        "commit_ms": 1e3 * m.commit_s,
        "first_stage_gbps": (m.stages[0].num_bytes / m.stages[0].seconds / 1e9) if m.stages[0].seconds else None,
        "src_steps_during": step_stats(src.engine.steps, m.started_at, m.ended_at),
        # The same batch: from the request's first token until the migration starts.
        "src_steps_before": step_stats(src.engine.steps, src_times[0], m.started_at),
    }


WARM_UP_TOKENS = 8192  # warm-up requests are at least this long (few of them, whatever the lengths measured)
WARM_UP_GROWTH = 256  # tokens a warm-up request may still decode on the destination while the others move


def warm_up_plan(s: Settings) -> tuple[int, int]:
    """(prompt length, number) of the warm-up requests: long ones (`WARM_UP_TOKENS`, or the
    longest length measured; under --max-model-len), as many as fit on the destination beside
    its background batch without crossing its free-block guard (`may_migrate_into`), at least one."""
    length = min(max(WARM_UP_TOKENS, max(s.lengths)), s.max_model_len - 1000)  # (parse_args leaves this room)
    per_request = -(-(length + WARM_UP_GROWTH) // s.block_size)
    spare = s.num_blocks - 2 * BACKGROUND_REQUESTS * BACKGROUND_PROMPT // s.block_size  # (and their growth)
    spare -= int(s.num_blocks * s.limits.dest_min_free_fraction) + 1  # the destination's guard keeps these free
    return length, max(1, spare // per_request)


async def warm_up(src: Llumlet, nc, chunks: Chunks, s: Settings) -> None:
    """Warm the KV path once (not reported): the source's pool is written in place (the sim's
    pools are lazily mapped, and a first copy into never-touched pages pays page faults a real
    engine's preallocated cache never does; the destination touches its own at start), then a
    few long requests are migrated (blocking copies) into the destination, where they stay until
    all have moved, and are dropped."""
    src.engine.kv_pool.data.fill(0)
    length, count = warm_up_plan(s)
    rids = [f"warmup-{i}-{time.monotonic_ns()}" for i in range(count)]
    for rid in rids:  # one at a time on the source; all of them stay on the destination
        await submit(nc, SRC, request(rid, length, 4000))
        await wait_until(lambda rid=rid: chunks.count_from(rid, SRC) > 0, 300, f"{rid} decoding")
        m = await src.migration.coordinator.migrate(rid, DST)
        if m is None or m.status is not MigrationStatus.FINISHED:
            raise RuntimeError(f"warm-up migration failed: {m and m.reason}")
    for rid in rids:
        await nc.publish(subjects.ABORT_ALL, encode(AbortRequest(rid, "warm-up done")))
    await asyncio.sleep(0.5)


async def recompute_once(s: Settings, length: int) -> dict:
    """TTFT of the whole sequence as a new request next to the same background batch."""
    engine = SimEngine(engine_config(s, 0))
    for i in range(BACKGROUND_REQUESTS):
        engine.add_request(request(f"bg-{i}", BACKGROUND_PROMPT, 100_000))
    while any(engine.get_request(f"bg-{i}").num_output_tokens == 0 for i in range(BACKGROUND_REQUESTS)):
        await engine.step()
    sequence = length + MIN_OUTPUT_BEFORE
    engine.add_request(request("recompute", sequence, 10))
    started = time.monotonic()
    while engine.get_request("recompute").num_output_tokens == 0:
        await engine.step()
    budget = engine.config.scheduler.max_num_batched_tokens
    chunks = -(-sequence // budget)
    modelled = sum(engine.latency.prefill_ms(min(budget, sequence - i * budget)) for i in range(chunks))
    return {"length": length, "ttft_ms": 1e3 * (time.monotonic() - started), "modelled_prefill_ms": modelled}


# ---------------------------------------------------------------------------------------------
# Where the client's stall goes (source record, destination log, token arrivals: one clock)
# ---------------------------------------------------------------------------------------------

# The stall, phase by phase: each from the previous point to its own (ms). Their sum less
# `src_token_to_client` is the stall itself.
HANDOVER_PHASES = (
    ("src_step_end_to_suspended", "src_last_step_end_at", "suspended_at"),
    ("suspended_to_last_stage_sent", "suspended_at", "commit_sent_at"),
    ("last_stage_to_dst_commit", "commit_sent_at", "committed_at"),
    ("dst_commit_to_in_engine", "committed_at", "in_engine_at"),
    ("in_engine_to_its_step", "in_engine_at", "first_step_started_at"),
    ("dst_first_step", "first_step_started_at", "first_step_ended_at"),
    ("dst_step_end_to_client", "first_step_ended_at", "dst_token_at_client"),
)


def source_stamps(m, steps: list[tuple], client: dict) -> dict:
    """The source's side of one handover (monotonic s): the end of its last step before the
    suspend (the step of its last token), the suspend, the last stage out, the commit's ack."""
    ends = [step[0] + step[1] for step in steps if step[0] + step[1] <= m.suspended_at]
    return {"src_last_step_end_at": max(ends) if ends else None, "suspended_at": m.suspended_at,
            "commit_sent_at": m.commit_sent_at, "acked_at": m.committed_at,
            "src_token_at_client": client["src_token_at_client"], "dst_token_at_client": client["dst_token_at_client"]}


def handover_phases(stamps: dict, destination: dict) -> dict | None:
    """One migration's stall by phase (ms), from its source stamps and its destination's log
    line (`parse_handovers`); None when either side is missing."""
    points = {**stamps, **destination}
    if any(points.get(key) is None for _, a, b in HANDOVER_PHASES for key in (a, b)):
        return None
    phases = {name: 1e3 * (points[b] - points[a]) for name, a, b in HANDOVER_PHASES}
    phases["src_token_to_client"] = 1e3 * (points["src_token_at_client"] - points["src_last_step_end_at"])
    phases["ack_after_dst_commit"] = 1e3 * (points["acked_at"] - points["committed_at"])
    return phases


def attach_phases(rows: list[dict], log_text: str) -> None:
    """Each row's `phases` from the destination's handover lines (matched by request id; vLLM's
    internal id carries a suffix)."""
    lines = parse_handovers(log_text)
    for row in rows:
        rid = row["request_id"]
        destination = lines.get(rid) or next((v for k, v in lines.items() if k.startswith(rid + "-")), None)
        row["phases"] = handover_phases(row["handover"], destination) if destination else None


def phases_by_length(rows: list[dict]) -> dict[int, dict[str, dict]]:
    """Per length and phase: median and P90 (ms) over the rows that have a breakdown."""
    out: dict[int, dict[str, dict]] = {}
    for length in sorted({r["length"] for r in rows}):
        have = [r["phases"] for r in rows if r["length"] == length and r.get("phases")]
        if have:
            out[length] = {name: {"median": statistics.median(p[name] for p in have),
                                  "p90": percentile([p[name] for p in have], 90)} for name in have[0]}
    return out


def print_phases(by_length: dict[int, dict[str, dict]]) -> None:
    if not by_length:
        print("\nno handover breakdown (no destination handover lines)")
        return
    names = list(next(iter(by_length.values())))
    print("\nwhere the stall goes, median (P90) ms per length; stall = sum of the phases less src_token_to_client")
    print(f"{'phase':>30}" + "".join(f"{length:>16}" for length in by_length))
    for name in names:
        cells = "".join(f"{by_length[length][name]['median']:8.2f} ({by_length[length][name]['p90']:5.1f})"
                        for length in by_length)
        print(f"{name:>30}{cells}")


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


async def run(s: Settings) -> dict:
    server = start_nats()
    s.out.parent.mkdir(parents=True, exist_ok=True)
    largest = (max(s.lengths) // s.block_size) * s.block_size * s.kv_bytes_per_token
    port_file = s.out.with_suffix(".raw_port")
    dst_proc = start_destination(s, server.url, s.out.with_suffix(".dst.log"), port_file)
    nc = await nats.connect(server.url)
    src = Llumlet(LlumletConfig(SRC, server.url, max_model_len=s.max_model_len, migration=s.limits),
                  TimedSimEngine(engine_config(s, s.kv_bytes_per_token)))
    recorder = None
    try:
        await src.start()
        dst_report = await wait_for_destination(nc)
        chunks = Chunks()
        recorder = await record_client(nc, server.url, OUTPUT_SUBJECT, chunks)
        for instance_id in (SRC, DST):
            for i in range(BACKGROUND_REQUESTS):
                await submit(nc, instance_id, request(f"bg-{instance_id}-{i}", BACKGROUND_PROMPT, 100_000))
        await wait_until(lambda: all(chunks.count_from(f"bg-{SRC}-{i}", SRC) for i in range(BACKGROUND_REQUESTS)),
                         60, "the background batch")
        await warm_up(src, nc, chunks, s)
        raw = await raw_links(largest, raw_port(port_file))
        live, blocking, recompute = [], [], []
        for length in s.lengths:
            for _ in range(s.repeats):
                migration = migrate_once(src, nc, chunks, length, None, "live")
                # The longest: raw copies of the same bytes right before and right after, each
                # measured as the stage is (one copy, same sender loop, warm buffers).
                live.append(await (beside_raw_copies(raw, migration) if length == max(s.lengths) else migration))
                report_line("live", live[-1])
            blocking.append(await migrate_once(src, nc, chunks, length, 1, "blocking"))
            report_line("blocking", blocking[-1])
            recompute.append(await recompute_once(s, length))
            print(f"recompute {length:>5}: TTFT {recompute[-1]['ttft_ms']:8.1f} ms "
                  f"(modelled prefill {recompute[-1]['modelled_prefill_ms']:.1f} ms)", flush=True)
        for link in raw.values():
            link.close()
        return summarize(s, live, blocking, recompute, dst_report)
    finally:
        await src.stop()
        await nc.close()
        if recorder is not None:
            recorder.kill()
        dst_proc.terminate()
        dst_proc.wait(20)
        server.stop()


def report_line(kind: str, r: dict) -> None:
    during, before = r["src_steps_during"], r["src_steps_before"]
    step_note = ""
    if during.get("steps") and before.get("steps"):
        step_note = f" src step {before['mean_wall_ms']:.1f}→{during['mean_wall_ms']:.1f} ms"
    gbps = f"{r['first_stage_gbps']:.2f} GB/s" if r["first_stage_gbps"] else "-"
    for name, (before, after) in r.get("raw_loopback_gbps", {}).items():
        gbps += f" (raw {name} before/after {before:.2f}/{after:.2f})"
    print(f"{kind:>8} {r['length']:>5}: downtime {r['downtime_ms']:6.2f} ms, client stall {r['client_stall_ms']:6.1f} ms "
          f"(its ITL {r['own_itl_ms']:.1f}), {r['num_stages']} stages, stage 0 {gbps},{step_note}", flush=True)


def summarize(s: Settings, live: list, blocking: list, recompute: list, dst_report: LoadReport) -> dict:
    def by_length(rows: list, key: str) -> dict[int, float]:
        values: dict[int, list[float]] = defaultdict(list)
        for row in rows:
            values[row["length"]].append(row[key])
        return {length: statistics.median(v) for length, v in values.items()}

    attach_phases(live, s.out.with_suffix(".dst.log").read_text(errors="replace"))
    live_down = by_length(live, "downtime_ms")
    shortest, longest = min(s.lengths), max(s.lengths)
    longest_live = [r for r in live if r["length"] == longest]
    transfer = statistics.median(r["first_stage_gbps"] or 0 for r in longest_live)
    transfer_vs_raw_by_link = transfer_vs_raw(longest_live)
    transfer_ratio = transfer_vs_raw_by_link["in_destination"]["median"]

    def pooled(key: str) -> dict:
        windows = [r[key] for r in live if r[key].get("steps")]
        total = sum(w["steps"] for w in windows)
        if not total:
            return {"steps": 0}
        return {"steps": total,
                **{f: sum(w[f] * w["steps"] for w in windows) / total
                   for f in ("mean_wall_ms", "mean_modelled_ms", "mean_overhead_ms")}}

    step_before, step_during = pooled("src_steps_before"), pooled("src_steps_during")
    modelled_step = statistics.median(r["modelled_decode_step_ms"] for r in live)
    recompute_ms = by_length(recompute, "ttft_ms")
    # Per run, wall time over modelled time of the decode steps (this normalizes the batch,
    # whose context grows), during the migration against before it.
    slowdowns = [(r["src_steps_during"]["mean_wall_ms"] / r["src_steps_during"]["mean_modelled_ms"])
                 / (r["src_steps_before"]["mean_wall_ms"] / r["src_steps_before"]["mean_modelled_ms"])
                 for r in live if r["src_steps_during"].get("steps") and r["src_steps_before"].get("steps")]
    step_ratio = statistics.median(slowdowns) if slowdowns else None
    goals = {
        "downtime_flat_longest_over_shortest": live_down[longest] / live_down[shortest],
        "downtime_max_over_one_decode_step": max(live_down.values()) / modelled_step,
        "recompute_over_live_at_longest": recompute_ms[longest] / live_down[longest],
        "transfer_over_raw_loopback": transfer_ratio,
        "src_decode_step_slowdown_during_migration": step_ratio,
    }
    return {
        "machine": {"cpus": multiprocessing.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "settings": {**dataclasses.asdict(s), "out": str(s.out), "background_requests": BACKGROUND_REQUESTS,
                     "background_prompt": BACKGROUND_PROMPT,
                     "destination_kv_address": dst_report.kv_address},
        # in_destination: the like-for-like baseline (goals); own_process: an idle receiver.
        "transfer_over_raw_loopback": transfer_vs_raw_by_link,
        "live_downtime_ms_by_length": live_down,
        "blocking_downtime_ms_by_length": by_length(blocking, "downtime_ms"),
        "recompute_ttft_ms_by_length": recompute_ms,
        "live_stages_by_length": by_length(live, "num_stages"),
        "live_client_stall_ms_by_length": stall_by_length(live),
        "live_stall_phases_ms_by_length": phases_by_length(live),
        "modelled_decode_step_ms": modelled_step,
        "src_step_ms": {"before_migration": step_before, "during_migration": step_during},
        "transfer_gbps_longest_first_stage": transfer,
        "goals": goals,
        "runs": {"live": live, "blocking": blocking, "recompute": recompute},
    }


def stall_by_length(rows: list[dict]) -> dict[int, dict]:
    """Per length: the client stall's median and P90, the requests' own median ITL, and the
    stall less that ITL (what the migration added: 0 is a perfect handover), in ms."""
    lengths = sorted({r["length"] for r in rows})
    out = {}
    for length in lengths:
        stalls = [r["client_stall_ms"] for r in rows if r["length"] == length]
        itls = [r["own_itl_ms"] for r in rows if r["length"] == length]
        extra = [r["client_stall_ms"] - r["own_itl_ms"] for r in rows if r["length"] == length]
        out[length] = {"median": statistics.median(stalls), "p90": percentile(stalls, 90),
                       "own_itl_median": statistics.median(itls), "extra_median": statistics.median(extra),
                       "extra_p90": percentile(extra, 90), "runs": len(stalls)}
    return out


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between order statistics (numpy's default); the value itself for one."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def print_stalls(stalls: dict[int, dict]) -> None:
    print("\nclient stall at the handover (ms): length  median  p90  its own ITL  stall-ITL median/p90  runs")
    for length, v in stalls.items():
        print(f"{length:>40}  {v['median']:6.1f}  {v['p90']:5.1f}  {v['own_itl_median']:11.1f}  "
              f"{v['extra_median']:9.1f} / {v['extra_p90']:.1f}  {v['runs']:4d}")


def print_summary(result: dict) -> None:
    print("\nlength  live(ms)  stages  blocking(ms)  recompute(ms)")
    for length in result["settings"]["lengths"]:
        print(f"{length:>6}  {result['live_downtime_ms_by_length'][length]:8.2f}  "
              f"{result['live_stages_by_length'][length]:6.1f}  {result['blocking_downtime_ms_by_length'][length]:12.1f}  "
              f"{result['recompute_ttft_ms_by_length'][length]:13.1f}")
    print_stalls(result["live_client_stall_ms_by_length"])
    print_phases(result["live_stall_phases_ms_by_length"])
    before, during = result["src_step_ms"]["before_migration"], result["src_step_ms"]["during_migration"]
    print(f"modelled A10 decode step of the source batch: {result['modelled_decode_step_ms']:.1f} ms")
    if before.get("steps") and during.get("steps"):
        print(f"source decode steps, wall (modelled) ms: before migration {before['mean_wall_ms']:.2f} "
              f"({before['mean_modelled_ms']:.2f}, {before['steps']} steps), during {during['mean_wall_ms']:.2f} "
              f"({during['mean_modelled_ms']:.2f}, {during['steps']} steps)")
    print(f"transfer (longest, stage 0, median): {result['transfer_gbps_longest_first_stage']:.2f} GB/s")
    print_transfer_vs_raw(result["transfer_over_raw_loopback"])
    for name, value in result["goals"].items():
        print(f"  {name}: {value:.2f}" if value is not None else f"  {name}: -")


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    parser.add_argument("--kv-bytes-per-token", type=int, default=32768,
                        help="fake KV bytes per token (LLaMA-7B has 512 KiB; see the module doc)")
    parser.add_argument("--repeats", type=int, default=4, help="live migrations per length (medians reported)")
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--gpu", default="A10", choices=["A10", "A100", "H100"])
    parser.add_argument("--out", type=Path, default=Path("results/migration_sim.json"))
    defaults = MigrationLimits()
    parser.add_argument("--stage-limit", type=int, default=defaults.stage_limit)
    parser.add_argument("--last-stage-blocks", type=int, default=defaults.last_stage_blocks)
    parser.add_argument("--frame-mib", type=int, default=defaults.frame_bytes >> 20)
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if not lengths or lengths[0] < args.block_size or lengths[-1] + 1000 > args.max_model_len:
        parser.error("lengths must be at least one block and leave room under --max-model-len")
    if args.kv_bytes_per_token <= 0 or args.kv_bytes_per_token % 8:
        parser.error("--kv-bytes-per-token must be a positive multiple of 8")
    try:
        limits = MigrationLimits(stage_limit=args.stage_limit, last_stage_blocks=args.last_stage_blocks,
                                 frame_bytes=args.frame_mib << 20)
    except ValueError as exc:
        parser.error(str(exc))
    return Settings(limits, lengths, args.kv_bytes_per_token, max(1, args.repeats), args.num_blocks, args.block_size,
                    args.max_model_len, args.gpu, args.out)


def run_and_report(benchmark, out: Path, summarize) -> int:
    """Run a benchmark coroutine on uvloop (as the llumlet service runs), write its JSON, print it."""
    started = time.monotonic()
    result = uvloop.run(benchmark)
    result["wall_s"] = time.monotonic() - started
    out.write_text(json.dumps(result, indent=2, default=str))
    summarize(result)
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_and_report(run(settings), settings.out, print_summary)


if __name__ == "__main__":
    sys.exit(main())
