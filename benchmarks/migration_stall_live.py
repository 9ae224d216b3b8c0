"""Migration stall through a real gateway (issue 20): what `corral:gateway_migration_stall_seconds`
says, read from the gateway's /metrics as Prometheus would, beside what an HTTP client sees.

    .venv/bin/python -m benchmarks.migration_stall_live [--streams 12] [--max-tokens 300] [--background 4]
        [--sim-time-scale 1] [--hold-max-ms 50] [--out results/migration_stall_live.json]

Two simulated llumlets (modelled A10 steps at `--sim-time-scale`) behind the real scheduler
(its own pairing off: this run's orders are the only migrations) and gateway. `--background`
streams decode on the destination throughout (other requests in its batch). Every measured
stream starts on the source (the destination is drained meanwhile) and streams `/v1/completions` over SSE;
once each has a quarter of its tokens the source is ordered to migrate to the destination, one
request after another, each live, mid-stream. Reported:
- the gateway's histogram: migrations counted, mean stall (sum / count), and its P50/P90 as
  PromQL's `histogram_quantile` estimates them from the buckets (what a dashboard shows);
- client side: each stream's median gap between SSE events (its own decode pace) and its stall:
  from the event that brought the source's last token to the one that brought the destination's
  first new token. A watcher on the bus (in this process) times those two tokens; the client's
  event for each is the first within 15 ms after. The tiny model's random token ids often
  decode to no text (a partial character), and the gateway sends no event for those: a stream
  whose handover tokens sent none is left out, and the count measured is printed.
Every stream must end with all its tokens (finish reason `length`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.pd_live import quantile
from services.llumlet.engines import model_vocabulary
from services.llumlet.migration.protocol import MigrationLimits
from services.tools.make_model import ensure_tiny_model
from shared.embedded_nats import start_nats
from shared import subjects
from shared.messages import DrainOrder, MigrateOrder, decode_chunks
from tests.support.cluster import Cluster, free_port
from tests.support.stream_watch import StreamWatch

SRC, DST = "stall-src", "stall-dst"
STALL = "corral:gateway_migration_stall_seconds"
HOLD = "corral:llumlet_migration_commit_hold_seconds"  # the destination's, from its own /metrics


async def stream(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    arrivals, response_id, finish = [], None, None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                response_id = event["id"]
                choice = event["choices"][0]
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    arrivals.append(time.monotonic())
    return {"arrivals": arrivals, "id": response_id, "finish_reason": finish}


def histogram(base_url: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets as (le, count), count, sum) of the histogram `name` on /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    buckets, count, total = [], 0.0, 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == f"{name}_count":
                count += sample.value
            elif sample.name == f"{name}_sum":
                total += sample.value
    return sorted(buckets), count, total


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """PromQL's estimate: linear within the bucket holding the q-th observation."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_le
            return lower_le + (le - lower_le) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_le, lower_count = le, count
    return None


@dataclass
class Handover:
    """When the bus carried a request's last token from the source and its first new one from the destination."""

    source_end: int = 0  # tokens the source sent
    last_from_source: float | None = None
    first_new_from_destination: float | None = None


async def run(args: argparse.Namespace, cluster: Cluster,
              prompts: list[list[int]]) -> tuple[list[dict], dict, list[list[float]]]:
    """The measured streams, their handovers, and the bus times of the background streams' tokens."""
    handovers: dict[str, Handover] = defaultdict(Handover)
    on_destination: dict[str, list[float]] = defaultdict(list)  # when the bus carried each request's tokens from it

    async def on_chunk(msg) -> None:
        now = time.monotonic()
        for chunk in decode_chunks(msg.data):
            if chunk.instance_id == DST:
                on_destination[chunk.request_id].append(now)
            h = handovers[chunk.request_id]
            end = chunk.start_index + len(chunk.token_ids)
            if chunk.instance_id == SRC and end > h.source_end:
                h.source_end, h.last_from_source = end, now
            elif chunk.instance_id == DST and end > h.source_end and h.first_new_from_destination is None:
                h.first_new_from_destination = now

    async with StreamWatch(cluster.nats_url) as watch, httpx.AsyncClient(
            base_url=cluster.base_url, timeout=600, limits=httpx.Limits(max_connections=None)) as http:
        await watch.nc.subscribe(f"{subjects.PREFIX}.gateway.*.out", cb=on_chunk)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        # Other requests in the destination's batch: background streams placed there first.
        await watch.order(SRC, DrainOrder(drain=True))
        assert await watch.wait_for(lambda latest: latest[SRC].draining, 10), "the source did not drain"
        background = [asyncio.create_task(stream(http, model, p, 4 * args.max_tokens))
                      for p in prompts[:args.background]]
        assert await watch.wait_for(lambda latest: latest[DST].num_running == args.background, 60)
        await watch.order(SRC, DrainOrder(drain=False))
        await watch.order(DST, DrainOrder(drain=True))  # every measured stream starts on the source
        assert await watch.wait_for(lambda latest: latest[DST].draining, 10), "the destination did not drain"
        tasks = [asyncio.create_task(stream(http, model, p, args.max_tokens)) for p in prompts]
        assert await watch.wait_for(lambda latest: latest[SRC].num_running == len(prompts), 60)
        await watch.order(DST, DrainOrder(drain=False))
        pair = f"stall-{uuid.uuid4().hex[:6]}"
        deadline = time.monotonic() + 60
        while len(watch.chunks) < len(prompts) + args.background or min(
                len(c) for c in watch.chunks.values()) < args.max_tokens // 4:
            assert time.monotonic() < deadline, "the streams did not get going"
            await asyncio.sleep(0.02)
        await watch.order(SRC, MigrateOrder(pair, DST))
        results = await asyncio.gather(*tasks)
        await watch.order(SRC, MigrateOrder(pair, DST, cancel=True))
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        others = [on_destination[rid] for rid, h in handovers.items() if h.last_from_source is None]
        return results, dict(handovers), others


def client_stall(arrivals: list[float], handover: Handover | None, within_s: float = 0.015) -> float | None:
    """The client's gap between the events that brought the handover's two tokens (None: either brought none)."""
    if handover is None or handover.last_from_source is None or handover.first_new_from_destination is None:
        return None

    def event_for(at: float) -> float | None:
        return next((t for t in arrivals if at <= t <= at + within_s), None)

    left, right = event_for(handover.last_from_source), event_for(handover.first_new_from_destination)
    return right - left if left is not None and right is not None else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--background", type=int, default=4, help="streams decoding on the destination throughout")
    parser.add_argument("--sim-time-scale", type=float, default=1.0)
    parser.add_argument("--hold-max-ms", type=float, default=1e3 * MigrationLimits().hold_max_s,
                        help="the llumlets' --migration-hold-max-ms (the destination's commit hold; 0: off)")
    parser.add_argument("--hold-step-share", type=float, default=MigrationLimits().hold_step_share,
                        help="the llumlets' --migration-hold-step-share (the hold at most this share of a step)")
    parser.add_argument("--notice-steps", type=int, default=MigrationLimits().notice_steps,
                        help="the llumlets' --migration-notice-steps (the source's notice, steps ahead)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/migration_stall_live.json"))
    args = parser.parse_args()
    if not 0 <= args.background <= args.streams:  # (the background streams are the first prompts)
        parser.error("--background must be between 0 and --streams")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_tiny_model(Path(tmp) / "tiny")
        vocab = model_vocabulary(str(model_dir))[0]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
        nats = start_nats()
        cluster = Cluster(nats.url, model_dir, Path(tmp) / "logs")
        cluster.log_dir.mkdir(parents=True, exist_ok=True)
        sim = ("--sim-time-scale", str(args.sim_time_scale), "--max-model-len", "4096",
               "--migration-hold-max-ms", str(args.hold_max_ms),
               "--migration-hold-step-share", str(args.hold_step_share),
               "--migration-notice-steps", str(args.notice_steps))
        try:
            cluster.start_scheduler("--no-enable-migration")
            cluster.start_llumlet(SRC, *sim)
            dst_metrics = f"http://127.0.0.1:{free_port()}"
            cluster.start_llumlet(DST, *sim, "--metrics-port", dst_metrics.rsplit(":", 1)[1])
            cluster.start_gateway()
            cluster.wait_ready(instances=2)
            before = histogram(cluster.base_url, STALL)
            migrated, handovers, others = asyncio.run(run(args, cluster, prompts))
            after = histogram(cluster.base_url, STALL)
            holds = histogram(dst_metrics, HOLD)
        finally:
            cluster.stop()
            nats.stop()

    buckets = [(le, count - dict(before[0]).get(le, 0.0)) for le, count in after[0]]
    count, total = after[1] - before[1], after[2] - before[2]
    own_gaps = [statistics.median([b - a for a, b in zip(r["arrivals"], r["arrivals"][1:])]) for r in migrated]
    stalls = [x for x in (client_stall(r["arrivals"], handovers.get(r["id"])) for r in migrated) if x is not None]
    bus = [h.first_new_from_destination - h.last_from_source for h in handovers.values()
           if h.first_new_from_destination is not None and h.last_from_source is not None]
    # The price of a handover to the destination's other requests: their gap across each commit.
    commits = [h.first_new_from_destination for h in handovers.values()
               if h.first_new_from_destination is not None and h.last_from_source is not None]
    others_gap = [b - a for times in others for a, b in zip(times, times[1:])]
    others_at_handover = [b - a for times in others for a, b in zip(times, times[1:])
                          if any(a < at <= b for at in commits)]
    report = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "gateway_histogram": {"migrations": count, "mean_s": total / count if count else None,
                              "p50_s": histogram_quantile(0.5, buckets), "p90_s": histogram_quantile(0.9, buckets),
                              "buckets": buckets},
        "bus": {"stall_p50_s": quantile(bus, 0.5), "stall_p90_s": quantile(bus, 0.9), "handovers": len(bus)},
        "client": {"own_gap_median_s": statistics.median(own_gaps), "stall_p50_s": quantile(stalls, 0.5),
                   "stall_p90_s": quantile(stalls, 0.9), "stalls_s": stalls},
        "completed": sum(r["finish_reason"] == "length" for r in migrated),
        "others": {"gap_median_s": quantile(others_gap, 0.5), "gap_at_handover_median_s": quantile(others_at_handover, 0.5),
                   "gap_at_handover_max_s": max(others_at_handover, default=None)},
        "destination_holds": {"count": holds[1], "mean_s": holds[2] / holds[1] if holds[1] else None},
        "streams": len(prompts),
    }
    g, c = report["gateway_histogram"], report["client"]
    print(f"{len(prompts)} streams of {args.max_tokens} tokens, each migrated once mid-stream, {args.background} "
          f"decoding on the destination (simulated A10 steps at time scale {args.sim_time_scale:g}; commit hold "
          f"{args.hold_max_ms:g} ms)")
    print(f"gateway {STALL}: {count:.0f} observed, mean {1e3 * g['mean_s']:.1f} ms, "
          f"P50 ~{1e3 * g['p50_s']:.1f} ms, P90 ~{1e3 * g['p90_s']:.1f} ms (bucket estimates)"
          if count else f"gateway {STALL}: nothing observed")
    b = report["bus"]
    if bus:
        print(f"on the bus (seen in this process): {len(bus)} handovers, stall P50 {1e3 * b['stall_p50_s']:.1f} ms, "
              f"P90 {1e3 * b['stall_p90_s']:.1f} ms")
    print(f"client: own gap median {1e3 * c['own_gap_median_s']:.1f} ms; stall P50 {_ms(c['stall_p50_s'])}, "
          f"P90 {_ms(c['stall_p90_s'])}, measured on {len(stalls)} of {len(prompts)} streams")
    o = report["others"]
    if others_at_handover:
        print(f"the destination's other requests (the price): gap median {1e3 * o['gap_median_s']:.1f} ms, across a "
              f"handover median {1e3 * o['gap_at_handover_median_s']:.1f} ms, max {1e3 * o['gap_at_handover_max_s']:.1f} ms")
    h = report["destination_holds"]
    print(f"destination {HOLD}: {h['count']:.0f} steps held" + (f", mean {1e3 * h['mean_s']:.1f} ms" if h["count"] else ""))
    print(f"completed with all their tokens: {report['completed']}/{len(prompts)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
