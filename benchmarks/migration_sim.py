"""Live migration micro-benchmark on the simulated engine (Llumnix §6.2 / Figure 10).

    .venv/bin/python -m benchmarks.migration_sim [--lengths 256,512,1024,2048,4096,8192]
        [--kv-bytes-per-token 32768] [--repeats 4] [--out results/migration_sim.json]

Two llumlets over a private nats-server: the source in this process (its engine's steps are
timed), the destination a separate `corral llumlet` process (as in production: its own event
loop, its own KV receiver). Both run simulated A10 steps at time scale 1 (real modelled time),
each with a background batch that keeps decoding. For each sequence length one request is
migrated live, another by a blocking copy (stage limit 1: stop, copy everything, resume), and
recompute is measured as the time to first token of the whole sequence as a new request on an
engine with the same batch (prefill + queueing). Data plane throughput is compared with a raw
loopback TCP copy of the same bytes to a separate process, measured in the same run (the best of
3 rounds x 2 sender modes, right before each migration). A single raw copy right after each
migration, against that same baseline, shows what the comparison allows a perfect data plane on
a machine this loaded ("raw single over raw best").

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


def _raw_receiver(conn, nbytes: int, rounds: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    buf = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += peer.recv_into(buf[got:])
        peer.sendall(b"k")
    peer.close()


async def raw_loopback_gbps(nbytes: int, rounds: int = 3, pick=max) -> dict:
    """`pick` (the best by default) of `rounds` copies: event-loop sender (as our data plane)
    and a blocking thread."""
    ctx = multiprocessing.get_context("spawn")
    results = {}
    for mode in ("event_loop", "thread"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_raw_receiver, args=(child, nbytes, rounds), daemon=True)
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


# ---------------------------------------------------------------------------------------------
# The two instances
# ---------------------------------------------------------------------------------------------


def engine_config(s: Settings, kv_bytes_per_token: int) -> SimEngineConfig:
    return SimEngineConfig(num_blocks=s.num_blocks, block_size=s.block_size, max_model_len=s.max_model_len,
                           gpu=s.gpu, time_scale=1.0, kv_bytes_per_token=kv_bytes_per_token)


def start_destination(s: Settings, nats_url: str, log_path: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "services.cli", "llumlet", "--nats-url", nats_url, "--instance-id", DST,
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
    dst_proc = start_destination(s, server.url, s.out.with_suffix(".dst.log"))
    nc = await nats.connect(server.url)
    src = Llumlet(LlumletConfig(SRC, server.url, max_model_len=s.max_model_len, migration=s.limits),
                  TimedSimEngine(engine_config(s, s.kv_bytes_per_token)))
    try:
        await src.start()
        dst_report = await wait_for_destination(nc)
        chunks = Chunks()
        await nc.subscribe(OUTPUT_SUBJECT, cb=chunks.on_chunk)
        largest = (max(s.lengths) // s.block_size) * s.block_size * s.kv_bytes_per_token
        for instance_id in (SRC, DST):
            for i in range(BACKGROUND_REQUESTS):
                await submit(nc, instance_id, request(f"bg-{instance_id}-{i}", BACKGROUND_PROMPT, 100_000))
        await wait_until(lambda: all(chunks.count_from(f"bg-{SRC}-{i}", SRC) for i in range(BACKGROUND_REQUESTS)),
                         60, "the background batch")
        await warm_up(src, nc, chunks, s)
        live, blocking, recompute, raw_runs = [], [], [], []
        for length in s.lengths:
            for _ in range(s.repeats):
                if length == max(s.lengths):  # the raw copy right before: the same machine load
                    raw_runs.append(await raw_loopback_gbps(largest))
                    print(f"raw loopback TCP, {largest / 2**20:.0f} MiB: event loop {raw_runs[-1]['event_loop']:.2f} "
                          f"GB/s, thread {raw_runs[-1]['thread']:.2f} GB/s", flush=True)
                live.append(await migrate_once(src, nc, chunks, length, None, "live"))
                if length == max(s.lengths):
                    live[-1]["raw_loopback_gbps_before"] = raw_runs[-1]
                    # One raw copy measured like the transfer: once, event-loop sender, into a
                    # receive buffer already touched (the first round pays its page faults).
                    after = await raw_loopback_gbps(largest, rounds=2, pick=lambda samples: samples[-1])
                    live[-1]["raw_single_gbps_after"] = after["event_loop"]
                report_line("live", live[-1])
            blocking.append(await migrate_once(src, nc, chunks, length, 1, "blocking"))
            report_line("blocking", blocking[-1])
            recompute.append(await recompute_once(s, length))
            print(f"recompute {length:>5}: TTFT {recompute[-1]['ttft_ms']:8.1f} ms "
                  f"(modelled prefill {recompute[-1]['modelled_prefill_ms']:.1f} ms)", flush=True)
        return summarize(s, raw_runs, live, blocking, recompute, dst_report)
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
    print(f"{kind:>8} {r['length']:>5}: downtime {r['downtime_ms']:6.2f} ms, token gap {r['token_gap_ms']:6.1f} ms "
          f"(ITL {r['itl_before_ms']:.1f}), {r['num_stages']} stages, stage 0 {gbps},{step_note}", flush=True)


def summarize(s: Settings, raw_runs: list[dict], live: list, blocking: list, recompute: list,
              dst_report: LoadReport) -> dict:
    def by_length(rows: list, key: str) -> dict[int, float]:
        values: dict[int, list[float]] = defaultdict(list)
        for row in rows:
            values[row["length"]].append(row[key])
        return {length: statistics.median(v) for length, v in values.items()}

    live_down = by_length(live, "downtime_ms")
    shortest, longest = min(s.lengths), max(s.lengths)
    longest_live = [r for r in live if r["length"] == longest]
    transfer = statistics.median(r["first_stage_gbps"] or 0 for r in longest_live)
    # Each transfer against the better raw copy measured just before it.
    transfer_ratio = statistics.median((r["first_stage_gbps"] or 0) / max(r["raw_loopback_gbps_before"].values())
                                       for r in longest_live)
    raw = {mode: statistics.median(run[mode] for run in raw_runs) for mode in ("event_loop", "thread")}
    raw_single_ratio = statistics.median(r["raw_single_gbps_after"] / max(r["raw_loopback_gbps_before"].values())
                                         for r in longest_live)
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
        "raw_loopback_gbps": raw,
        "live_downtime_ms_by_length": live_down,
        "blocking_downtime_ms_by_length": by_length(blocking, "downtime_ms"),
        "recompute_ttft_ms_by_length": recompute_ms,
        "live_stages_by_length": by_length(live, "num_stages"),
        "live_token_gap_ms_by_length": by_length(live, "token_gap_ms"),
        "modelled_decode_step_ms": modelled_step,
        "src_step_ms": {"before_migration": step_before, "during_migration": step_during},
        "transfer_gbps_longest_first_stage": transfer,
        "raw_single_over_raw_best": raw_single_ratio,  # the ceiling of transfer_over_raw_loopback
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
    raw = result["raw_loopback_gbps"]
    print(f"transfer (longest, stage 0, median): {result['transfer_gbps_longest_first_stage']:.2f} GB/s; raw loopback "
          f"(median): event loop {raw['event_loop']:.2f}, thread {raw['thread']:.2f} GB/s")
    for name, value in result["goals"].items():
        print(f"  {name}: {value:.2f}" if value is not None else f"  {name}: -")
    print(f"  (a single raw copy scores {result['raw_single_over_raw_best']:.2f} against the same raw baseline)")


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


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    started = time.monotonic()
    result = uvloop.run(run(settings))  # as the llumlet service runs
    result["wall_s"] = time.monotonic() - started
    settings.out.write_text(json.dumps(result, indent=2, default=str))
    print_summary(result)
    print(f"wrote {settings.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
