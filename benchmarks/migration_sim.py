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
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import nats
import uvloop

from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine, SimEngineConfig
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from services.llumlet.service import Llumlet
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import AbortRequest, GenerateRequest, LoadReport, SamplingParams, TokenChunk, decode, encode

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
    """Arrival time and publisher of every token chunk, per request."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[tuple[float, TokenChunk]]] = defaultdict(list)

    async def on_chunk(self, msg) -> None:
        chunk = decode(msg.data, TokenChunk)
        self.by_request[chunk.request_id].append((time.monotonic(), chunk))

    def count_from(self, request_id: str, instance_id: str) -> int:
        return sum(len(c.token_ids) for _, c in self.by_request[request_id] if c.instance_id == instance_id)

    def token_times(self, request_id: str, instance_id: str) -> list[float]:
        return [t for t, c in self.by_request[request_id] if c.instance_id == instance_id and c.token_ids]


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------------------------------------
# Raw loopback baseline: the same bytes to a plain receiver process, no framing, no fusion
# ---------------------------------------------------------------------------------------------


def _raw_receiver(conn, nbytes: int) -> None:
    """Reads `nbytes` into a touched buffer and answers one byte, for as long as the sender goes on."""
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    buf = memoryview(bytearray(b"\x01" * nbytes))  # touched: the destination's KV pool is warm too
    while True:
        got = 0
        while got < nbytes:
            n = peer.recv_into(buf[got:])
            if n == 0:
                return
            got += n
        peer.sendall(b"k")


async def raw_loopback_gbps(nbytes: int, rounds: int = 3, pick=max) -> dict:
    """`pick` (the best by default) of `rounds` copies to a fresh receiver process, per sender mode
    (event loop, blocking thread). Kept for benchmarks/migration_vllm.py; a best-of-N figure
    against a single transfer favours the raw side (see `RawLoopback` for the like-for-like one)."""
    ctx = multiprocessing.get_context("spawn")
    results = {}
    for mode in ("event_loop", "thread"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_raw_receiver, args=(child, nbytes), daemon=True)
        proc.start()
        port = parent.recv()
        payload = memoryview(bytearray(b"\x5a" * nbytes))
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(rounds):
            started = time.monotonic()
            if mode == "event_loop":
                sock.setblocking(False)
                loop = asyncio.get_running_loop()
                await loop.sock_sendall(sock, payload)
                await loop.sock_recv(sock, 1)
            else:
                sock.setblocking(True)
                await asyncio.to_thread(lambda: (sock.sendall(payload), sock.recv(1)))
            samples.append(nbytes / (time.monotonic() - started) / 1e9)
        sock.close()
        proc.join(5)
        results[mode] = pick(samples)
    return results


class RawLoopback:
    """A raw loopback TCP copy of `nbytes`, measured the way a stage is: one copy at a time, sent
    from this process's event loop (the source llumlet's, its engine stepping beside it) to a
    receiver process that lives for the whole run (as the destination llumlet does), both
    buffers warm. No framing, no checksum, no acks but the one at the end."""

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
            self._proc = ctx.Process(target=_raw_receiver, args=(child, self.nbytes), daemon=True)
            self._proc.start()
            port = await asyncio.to_thread(parent.recv)
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)
        await self.copy()  # the receiver's first copy is not measured (its socket ramps up)

    async def copy(self) -> float:
        """GB/s of one copy (until the receiver's answer)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        await loop.sock_sendall(self._sock, self._payload)
        if await loop.sock_recv(self._sock, 1) != b"k":
            raise RuntimeError("raw loopback receiver went away")
        return self.nbytes / (time.monotonic() - started) / 1e9

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._proc is not None:
            self._proc.join(5)


class _RawSink(asyncio.BufferedProtocol):
    """The raw receiver inside the destination llumlet: reads `nbytes` copies into a warm buffer
    on the llumlet's own event loop (beside its engine, as the KV receiver is) and answers each
    with one byte. No framing, no checksum."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = memoryview(bytearray(b"\x01" * nbytes))
        self.got = 0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer[self.got :]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got == len(self.buffer):
            self.got = 0
            self.transport.write(b"k")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


class _DestinationWithRawSink:
    """The destination llumlet, plus a raw loopback receiver on its event loop (its port is
    written to `port_file`)."""

    def __init__(self, llumlet, nbytes: int, port_file: Path) -> None:
        self.llumlet, self.nbytes, self.port_file = llumlet, nbytes, port_file
        self.server = None

    async def start(self) -> None:
        await self.llumlet.start()
        resident = _rss_bytes()
        self.llumlet.engine.kv_pool.data.fill(0)  # as the source's (see `warm_up`); no request yet
        print(f"destination KV pool touched: RSS {resident / 2**20:.0f} -> {_rss_bytes() / 2**20:.0f} MiB", flush=True)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _RawSink(self.nbytes), "127.0.0.1", 0)
        self.port_file.write_text(str(self.server.sockets[0].getsockname()[1]))

    async def stop(self) -> None:
        self.server.close()
        await self.llumlet.stop()


def serve_destination(argv: list[str]) -> None:
    """`corral llumlet ARGV` (the same config, engine and runner) with a raw receiver beside it:
    argv[0] is the raw copy's size, argv[1] the file that gets the raw receiver's port."""
    from services.cli import build_parser
    from services.llumlet.config import config_from_args
    from services.llumlet.engines import create_engine
    from services.runner import run, serve_until_signalled

    nbytes, port_file = int(argv[0]), Path(argv[1])
    config = config_from_args(build_parser().parse_args(["llumlet", *argv[2:]]))
    llumlet = Llumlet(config, create_engine(config))
    run(serve_until_signalled(_DestinationWithRawSink(llumlet, nbytes, port_file), wait=llumlet.wait_failed))


# ---------------------------------------------------------------------------------------------
# The two instances
# ---------------------------------------------------------------------------------------------


def engine_config(s: Settings, kv_bytes_per_token: int) -> SimEngineConfig:
    return SimEngineConfig(num_blocks=s.num_blocks, block_size=s.block_size, max_model_len=s.max_model_len,
                           gpu=s.gpu, time_scale=1.0, kv_bytes_per_token=kv_bytes_per_token)


def start_destination(s: Settings, nats_url: str, log_path: Path, raw_bytes: int, port_file: Path) -> subprocess.Popen:
    """`corral llumlet` with a raw loopback receiver on its event loop (`serve_destination`)."""
    launcher = "import sys; from benchmarks.migration_sim import serve_destination; serve_destination(sys.argv[1:])"
    args = [sys.executable, "-c", launcher, str(raw_bytes), str(port_file),
            "--nats-url", nats_url, "--instance-id", DST,
            "--engine", "sim", "--sim-num-blocks", str(s.num_blocks), "--sim-block-size", str(s.block_size),
            "--max-model-len", str(s.max_model_len), "--sim-gpu", s.gpu, "--sim-time-scale", "1",
            "--sim-kv-bytes-per-token", str(s.kv_bytes_per_token)]
    return subprocess.Popen(args, cwd=REPO, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)


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
    await wait_until(lambda: chunks.count_from(rid, DST) > 0, 30, f"{rid}'s first token on the destination")
    await nc.publish(subjects.ABORT_ALL, encode(AbortRequest(rid, "benchmark done")))
    src_times, dst_times = chunks.token_times(rid, SRC), chunks.token_times(rid, DST)
    itl = statistics.median(b - a for a, b in zip(src_times[-6:], src_times[-5:]))
    duration = m.ended_at - m.started_at
    return {
        "length": length,
        "downtime_ms": 1e3 * m.downtime_s,
        "token_gap_ms": 1e3 * (dst_times[0] - src_times[-1]),
        "itl_before_ms": 1e3 * itl,
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


async def warm_up(src: Llumlet, nc, chunks: Chunks, s: Settings) -> None:
    """Touch the KV memory once (not reported): the sim's pools are lazily mapped, and a first
    copy into never-touched pages pays page faults a real engine's preallocated cache never does.
    The source pool is written in place; the destination's is filled by migrating long requests
    into it (blocking copies) that are then dropped."""
    src.engine.kv_pool.data.fill(0)
    length = min(max(s.lengths), s.max_model_len - 2000)
    spare_blocks = s.num_blocks - 2 * BACKGROUND_REQUESTS * BACKGROUND_PROMPT // s.block_size  # (and growth)
    spare_blocks -= int(s.num_blocks * s.limits.dest_min_free_fraction)  # the destination's guard keeps these free
    rids = [f"warmup-{i}-{time.monotonic_ns()}" for i in range(max(1, spare_blocks * s.block_size // length))]
    for rid in rids:  # one at a time on the source; all of them stay on the destination
        await submit(nc, SRC, request(rid, length, 4000))
        await wait_until(lambda: chunks.count_from(rid, SRC) > 0, 300, f"{rid} decoding")
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
    chunks = -(-sequence // engine.config.max_num_batched_tokens)
    modelled = sum(engine.latency.prefill_ms(min(engine.config.max_num_batched_tokens, sequence - i * engine.config.max_num_batched_tokens))
                   for i in range(chunks))
    return {"length": length, "ttft_ms": 1e3 * (time.monotonic() - started), "modelled_prefill_ms": modelled}


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


async def run(s: Settings) -> dict:
    server = start_nats()
    s.out.parent.mkdir(parents=True, exist_ok=True)
    largest = (max(s.lengths) // s.block_size) * s.block_size * s.kv_bytes_per_token
    port_file = s.out.with_suffix(".raw_port")
    port_file.unlink(missing_ok=True)
    dst_proc = start_destination(s, server.url, s.out.with_suffix(".dst.log"), largest, port_file)
    nc = await nats.connect(server.url)
    src = Llumlet(LlumletConfig(SRC, server.url, max_model_len=s.max_model_len, migration=s.limits),
                  TimedSimEngine(engine_config(s, s.kv_bytes_per_token)))
    try:
        await src.start()
        dst_report = await wait_for_destination(nc)
        chunks = Chunks()
        await nc.subscribe(OUTPUT_SUBJECT, cb=chunks.on_chunk)
        for instance_id in (SRC, DST):
            for i in range(BACKGROUND_REQUESTS):
                await submit(nc, instance_id, request(f"bg-{instance_id}-{i}", BACKGROUND_PROMPT, 100_000))
        await wait_until(lambda: all(chunks.count_from(f"bg-{SRC}-{i}", SRC) for i in range(BACKGROUND_REQUESTS)),
                         60, "the background batch")
        await warm_up(src, nc, chunks, s)
        # Raw copies into the destination llumlet (its event loop, beside its engine: the KV
        # receiver's conditions) and into a receiver process of its own (an idle one).
        raw = {"in_destination": RawLoopback(largest, int(port_file.read_text())), "own_process": RawLoopback(largest)}
        for link in raw.values():
            await link.start()
        live, blocking, recompute = [], [], []
        for length in s.lengths:
            for _ in range(s.repeats):
                # The longest: raw copies of the same bytes right before and right after, each
                # measured as the stage is (one copy, same sender loop, warm buffers).
                before = {name: await link.copy() for name, link in raw.items()} if length == max(s.lengths) else None
                live.append(await migrate_once(src, nc, chunks, length, None, "live"))
                if before is not None:
                    after = {name: await raw[name].copy() for name in reversed(raw)}
                    live[-1]["raw_loopback_gbps"] = {name: [before[name], after[name]] for name in raw}
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
    print(f"{kind:>8} {r['length']:>5}: downtime {r['downtime_ms']:6.2f} ms, token gap {r['token_gap_ms']:6.1f} ms "
          f"(ITL {r['itl_before_ms']:.1f}), {r['num_stages']} stages, stage 0 {gbps},{step_note}", flush=True)


def summarize(s: Settings, live: list, blocking: list, recompute: list, dst_report: LoadReport) -> dict:
    def by_length(rows: list, key: str) -> dict[int, float]:
        values: dict[int, list[float]] = defaultdict(list)
        for row in rows:
            values[row["length"]].append(row[key])
        return {length: statistics.median(v) for length, v in values.items()}

    live_down = by_length(live, "downtime_ms")
    shortest, longest = min(s.lengths), max(s.lengths)
    longest_live = [r for r in live if r["length"] == longest]
    transfer = statistics.median(r["first_stage_gbps"] or 0 for r in longest_live)
    def against(name: str) -> dict:
        """Each transfer against the raw copies right before and after it (their mean; the
        better of the two is the stricter reading)."""
        ratios = [(r["first_stage_gbps"] or 0) / statistics.fmean(r["raw_loopback_gbps"][name]) for r in longest_live]
        strict = [(r["first_stage_gbps"] or 0) / max(r["raw_loopback_gbps"][name]) for r in longest_live]
        copies = [gbps for r in longest_live for gbps in r["raw_loopback_gbps"][name]]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "runs": ratios,
                "strict_median": statistics.median(strict),
                "raw_gbps": {"median": statistics.median(copies), "min": min(copies), "max": max(copies)}}

    transfer_vs_raw = {name: against(name) for name in longest_live[0]["raw_loopback_gbps"]}
    transfer_ratio = transfer_vs_raw["in_destination"]["median"]
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
        "transfer_over_raw_loopback": transfer_vs_raw,
        "live_downtime_ms_by_length": live_down,
        "blocking_downtime_ms_by_length": by_length(blocking, "downtime_ms"),
        "recompute_ttft_ms_by_length": recompute_ms,
        "live_stages_by_length": by_length(live, "num_stages"),
        "live_token_gap_ms_by_length": by_length(live, "token_gap_ms"),
        "modelled_decode_step_ms": modelled_step,
        "src_step_ms": {"before_migration": step_before, "during_migration": step_during},
        "transfer_gbps_longest_first_stage": transfer,
        "goals": goals,
        "runs": {"live": live, "blocking": blocking, "recompute": recompute},
    }


def print_summary(result: dict) -> None:
    print("\nlength  live(ms)  stages  blocking(ms)  recompute(ms)  token-gap(ms)")
    for length in result["settings"]["lengths"]:
        print(f"{length:>6}  {result['live_downtime_ms_by_length'][length]:8.2f}  "
              f"{result['live_stages_by_length'][length]:6.1f}  {result['blocking_downtime_ms_by_length'][length]:12.1f}  "
              f"{result['recompute_ttft_ms_by_length'][length]:13.1f}  {result['live_token_gap_ms_by_length'][length]:13.1f}")
    before, during = result["src_step_ms"]["before_migration"], result["src_step_ms"]["during_migration"]
    print(f"modelled A10 decode step of the source batch: {result['modelled_decode_step_ms']:.1f} ms")
    if before.get("steps") and during.get("steps"):
        print(f"source decode steps, wall (modelled) ms: before migration {before['mean_wall_ms']:.2f} "
              f"({before['mean_modelled_ms']:.2f}, {before['steps']} steps), during {during['mean_wall_ms']:.2f} "
              f"({during['mean_modelled_ms']:.2f}, {during['steps']} steps)")
    print(f"transfer (longest, stage 0, median): {result['transfer_gbps_longest_first_stage']:.2f} GB/s")
    for name, ratio in result["transfer_over_raw_loopback"].items():
        raw = ratio["raw_gbps"]
        print(f"raw loopback into {name.replace('_', ' ')}: single copies median {raw['median']:.2f} "
              f"[{raw['min']:.2f}-{raw['max']:.2f}] GB/s; transfer over it, per migration: median "
              f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}] (against the better of its two raw "
              f"copies: {ratio['strict_median']:.2f})")
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
