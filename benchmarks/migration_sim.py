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

`--hold-max-ms` (the destination's `--migration-hold-max-ms`; 0: off) bounds the destination's hold
of its next step for a commit the source said is imminent (`services/llumlet/migration/commit_hold.py`);
run it at 0 and at the default back to back to compare. Its price is reported beside the stall: the
destination's other requests' token gap around the request's first step there (the end of the step
before → the end of that step, the hold included; from its log), against its typical step; and the
same at the client (their largest gap overlapping the handover, against their usual gap).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nats
import uvloop

from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine, SimEngineConfig
from shared.engine_model.config import SchedulerConfig
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from services.llumlet.service import Llumlet
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import AbortRequest, GenerateRequest, LoadReport, SamplingParams, decode, encode
from shared.nats_client import request as nats_request
from benchmarks.raw_loopback import raw_links, beside_raw_copies, launch_destination, raw_port
from benchmarks.client_stall import Chunks, record_client, source_stamps
from benchmarks.migration_sim_report import report_line, summarize, print_summary


REPO = Path(__file__).resolve().parents[1]
SRC, DST = "bench-src", "bench-dst"
BACKGROUND_PROMPT = 1024  # four of these decode on each instance throughout
BACKGROUND_REQUESTS = 4
BACKGROUND_WARM_TOKENS = 4  # a fresh batch has decoded this many tokens before a measurement
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


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------------------------------------
# Raw loopback baseline: the same bytes to a plain receiver process, no framing, no fusion
# ---------------------------------------------------------------------------------------------


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
                               "--sim-kv-bytes-per-token", str(s.kv_bytes_per_token),
                               "--migration-hold-max-ms", str(1e3 * s.limits.hold_max_s),
                               "--migration-hold-step-share", str(s.limits.hold_step_share)], port_file, log_path)


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
    reply = await nats_request(nc, subjects.llumlet(instance_id, "generate"), encode(req), 10)
    assert b"error" not in reply.data, reply.data


class Background:
    """The background batch on both instances, started afresh before each measured migration:
    the same prompts at the same time, so the two batches hold the same context when the
    request moves. (Kept from the start of the run, the source's trailed the destination's by
    hundreds of tokens each, because the source also prefilled every measured and warm-up
    request: the destination's steps then ran 1-2 ms longer than the source's for that alone,
    and the request's first step there looked that much slower than its own gap.)"""

    def __init__(self, nc, chunks: Chunks) -> None:
        self.nc, self.chunks = nc, chunks
        self.generation = 0

    def ids(self, instance_id: str) -> list[str]:
        return [f"bg-{instance_id}-{self.generation}-{i}" for i in range(BACKGROUND_REQUESTS)]

    async def restart(self) -> None:
        if self.generation:
            for rid in self.ids(SRC) + self.ids(DST):
                await self.nc.publish(subjects.ABORT_ALL, encode(AbortRequest(rid, "background renewed")))
        self.generation += 1
        for instance_id in (SRC, DST):
            for rid in self.ids(instance_id):
                await submit(self.nc, instance_id, request(rid, BACKGROUND_PROMPT, 100_000))
        await wait_until(lambda: all(self.chunks.count_from(rid, instance_id) >= BACKGROUND_WARM_TOKENS
                                     for instance_id in (SRC, DST) for rid in self.ids(instance_id)),
                         120, "the background batch")


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


async def migrate_once(src: Llumlet, nc, chunks: Chunks, background: Background, length: int,
                       stage_limit: int | None, tag: str) -> dict:
    rid = f"{tag}-{length}-{time.monotonic_ns()}"
    await background.restart()
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
        # The price of a hold: the destination's other requests' largest gap around the handover.
        "others_client": chunks.largest_gap_around(background.ids(DST),
                                                   m.commit_sent_at, client["dst_token_at_client"]),
        "modelled_decode_step_ms": 1e3 * modelled_step,
        "stages": [dataclasses.asdict(stage) for stage in m.stages],
        "num_stages": len(m.stages),
        "last_stage_kib": m.stages[-1].num_bytes / 1024,
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


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


async def run(s: Settings) -> dict:
    server = start_nats()
    s.out.parent.mkdir(parents=True, exist_ok=True)
    largest = (max(s.lengths) // s.block_size) * s.block_size * s.kv_bytes_per_token
    port_file = s.out.with_suffix(".raw_port")
    dst_proc = start_destination(s, server.url, s.out.with_suffix(".dst.log"), port_file)
    nc = src = recorder = None
    try:  # (from here on, whatever fails, the destination and the server are stopped)
        nc = await nats.connect(server.url)
        src = Llumlet(LlumletConfig(SRC, server.url, max_model_len=s.max_model_len, migration=s.limits),
                      TimedSimEngine(engine_config(s, s.kv_bytes_per_token)))
        await src.start()
        dst_report = await wait_for_destination(nc)
        chunks = Chunks()
        recorder = await record_client(nc, server.url, OUTPUT_SUBJECT, chunks)
        background = Background(nc, chunks)
        await background.restart()
        await warm_up(src, nc, chunks, s)
        raw = await raw_links(largest, raw_port(port_file))
        live, blocking, recompute = [], [], []
        for length in s.lengths:
            for _ in range(s.repeats):
                migration = migrate_once(src, nc, chunks, background, length, None, "live")
                # The longest: raw copies of the same bytes right before and right after, each
                # measured as the stage is (one copy, same sender loop, warm buffers).
                live.append(await (beside_raw_copies(raw, migration) if length == max(s.lengths) else migration))
                report_line("live", live[-1])
            blocking.append(await migrate_once(src, nc, chunks, background, length, 1, "blocking"))
            report_line("blocking", blocking[-1])
            recompute.append(await recompute_once(s, length))
            print(f"recompute {length:>5}: TTFT {recompute[-1]['ttft_ms']:8.1f} ms "
                  f"(modelled prefill {recompute[-1]['modelled_prefill_ms']:.1f} ms)", flush=True)
        for link in raw.values():
            link.close()
        workload = {"background_requests": BACKGROUND_REQUESTS, "background_prompt": BACKGROUND_PROMPT}
        return summarize(s, live, blocking, recompute, dst_report, workload)
    finally:
        if src is not None:
            await src.stop()
        if nc is not None:
            await nc.close()
        if recorder is not None:
            recorder.kill()
        dst_proc.terminate()
        try:
            dst_proc.wait(20)
        except subprocess.TimeoutExpired:
            dst_proc.kill()
        server.stop()


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
    parser.add_argument("--hold-max-ms", type=float, default=1e3 * defaults.hold_max_s,
                        help="the destination holds a step this long for an imminent commit (0: off)")
    parser.add_argument("--hold-step-share", type=float, default=defaults.hold_step_share,
                        help="and at most this share of its typical step")
    parser.add_argument("--notice-steps", type=int, default=defaults.notice_steps,
                        help="the source notices the commit this many of its steps ahead (the default 1: "
                             "hold or not; 3: the destination paces its steps to meet it); run both to compare")
    parser.add_argument("--token-frames", action=argparse.BooleanOptionalAction, default=defaults.token_frames,
                        help="the source sends a block not yet full by token slot (--no-token-frames: whole blocks; "
                             "run both back to back to compare the last stage)")
    parser.add_argument("--frame-mib", type=int, default=defaults.frame_bytes >> 20)
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if not lengths or lengths[0] < args.block_size or lengths[-1] + 1000 > args.max_model_len:
        parser.error("lengths must be at least one block and leave room under --max-model-len")
    if args.kv_bytes_per_token <= 0 or args.kv_bytes_per_token % 8:
        parser.error("--kv-bytes-per-token must be a positive multiple of 8")
    try:
        limits = MigrationLimits(stage_limit=args.stage_limit, last_stage_blocks=args.last_stage_blocks,
                                 frame_bytes=args.frame_mib << 20, hold_max_s=args.hold_max_ms / 1e3,
                                 hold_step_share=args.hold_step_share, token_frames=args.token_frames,
                                 notice_steps=args.notice_steps)
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
