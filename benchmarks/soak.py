"""Soak: many concurrent streams against the sim engine for a long time; does anything grow?

Closed-loop clients keep `--streams` streams open for `--duration-s` (issue 14 asks for 2,000
streams for 30 min: `--streams 2000 --duration-s 1800`); each asks for a random output length and
one in ten is cut by its client part-way. Every `--sample-s` the gateway's and the llumlets'
resident memory (VmRSS) and open file descriptors are sampled from /proc. The report: baseline
(before load), first and last sample under load (memory flat means last ≈ first), peak, and
after the load ended (file descriptors back to baseline). Writes results/soak.json.

Usage: .venv/bin/python -m benchmarks.soak [--streams 2000] [--duration-s 1800]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvloop

from shared.embedded_nats import start_nats
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver

ROOT = Path(__file__).resolve().parents[1]


def proc_usage(pid: int) -> dict:
    """Resident memory (MiB) and open file descriptors of one process."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return {"rss_mib": round(rss_kib / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def sample(cluster: Cluster) -> dict:
    return {name: proc_usage(proc.process.pid) for name, proc in cluster.procs.items() if proc.alive()}


async def client_loop(http: httpx.AsyncClient, model: str, rng: random.Random, until: float, counts: dict) -> None:
    while time.monotonic() < until:
        tokens = rng.randint(20, 300)
        cut_after = rng.randint(1, 10) if rng.random() < 0.1 else None
        body = {"model": model, "prompt": [rng.randrange(1, 200) for _ in range(rng.randint(4, 64))],
                "max_tokens": tokens, "stream": True, "ignore_eos": True}
        events = 0
        try:
            async with http.stream("POST", "/v1/completions", json=body) as reply, _counted(counts, "open"):
                if reply.status_code != 200:
                    counts[f"http_{reply.status_code}"] = counts.get(f"http_{reply.status_code}", 0) + 1
                    await asyncio.sleep(0.5)
                    continue
                async for data in reply.aiter_bytes():
                    events += data.count(b"\n\ndata: {") + data.startswith(b"data: {")
                    if b'"error": {' in data or b'"error":{' in data:
                        counts["stream_errors"] += 1
                        message = data[data.find(b'"message"'):][:120].decode(errors="replace")
                        counts.setdefault("error_samples", set()).add(message)
                        break
                    if cut_after is not None and events >= cut_after:
                        counts["cut"] += 1
                        break
                else:
                    counts["completed"] += 1
        except httpx.HTTPError as exc:  # (a read timeout: 120 s without a byte; before its first token: queued)
            key = f"{type(exc).__name__}_{'mid_stream' if events else 'before_first_token'}"
            counts[key] = counts.get(key, 0) + 1


class _counted:
    """`counts[key]` is the number of streams inside the block right now (sampled)."""

    def __init__(self, counts: dict, key: str) -> None:
        self.counts, self.key = counts, key

    async def __aenter__(self) -> None:
        self.counts[self.key] = self.counts.get(self.key, 0) + 1

    async def __aexit__(self, *exc) -> None:
        self.counts[self.key] -= 1


async def gateway_in_flight(http: httpx.AsyncClient) -> float | None:
    """The gateway's own count of requests dispatched and not finished (its /metrics)."""
    try:
        text = (await http.get("/metrics", timeout=10)).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("corral:gateway_requests_in_flight{")]
    return sum(values) if values else None


async def soak(cluster: Cluster, args: argparse.Namespace, samples: list) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.streams)
    counts = {"completed": 0, "cut": 0, "stream_errors": 0}
    async with (httpx.AsyncClient(base_url=cluster.base_url, timeout=120, limits=limits) as http,
                NatsObserver(cluster.nats_url) as observer):  # (the engines' queues and preemptions)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        until = time.monotonic() + args.duration_s
        rng = random.Random(0)
        clients = [asyncio.create_task(client_loop(http, model, random.Random(rng.random()), until, counts))
                   for _ in range(args.streams)]
        started = time.monotonic()
        while not all(c.done() for c in clients):
            await asyncio.sleep(args.sample_s)
            loads = list(observer.latest.values())
            samples.append({"t_s": round(time.monotonic() - started, 1), "streams_open": counts.get("open", 0),
                            "gateway_in_flight": await gateway_in_flight(http),
                            "engines_waiting": sum(r.num_waiting for r in loads),
                            "engines_preemptions": sum(r.num_preemptions_total for r in loads), **sample(cluster)})
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
        await asyncio.gather(*clients)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--sim-args", default="--sim-time-scale 1.0 --sim-num-blocks 8000",
                        help="extra llumlet flags (enough blocks that the streams fit)")
    parser.add_argument("--out", default=str(ROOT / "results" / "soak.json"))
    parser.add_argument("--keep-logs", default="", metavar="DIR", help="copy every process's log here")
    args = parser.parse_args(argv)

    from services.tools.make_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_tiny_model(model_dir, seed=0)
        (Path(tmp) / "logs").mkdir()
        server = start_nats()
        cluster = Cluster(server.url, model_dir, Path(tmp) / "logs")
        try:
            cluster.start_scheduler()
            for i in range(args.instances):
                cluster.start_llumlet(f"sim-{i}", *args.sim_args.split())
            cluster.start_gateway("--max-requests-in-flight", str(max(4096, args.streams)))
            cluster.wait_ready(instances=args.instances)
            time.sleep(2.0)
            baseline = sample(cluster)
            samples: list[dict] = []
            counts = uvloop.run(soak(cluster, args, samples))  # (the client's own CPU: 2,000 streams)
            time.sleep(5.0)  # connections close, aborts land
            after = sample(cluster)
        finally:
            cluster.stop()
            server.stop()
            if args.keep_logs:
                shutil.copytree(Path(tmp) / "logs", args.keep_logs, dirs_exist_ok=True)
    under_load = [s for s in samples]
    counts["error_samples"] = sorted(counts.get("error_samples", ()))[:5]
    report = {"args": vars(args), "counts": counts, "baseline": baseline, "after": after,
              "first_under_load": under_load[0] if under_load else None,
              "last_under_load": under_load[-1] if under_load else None, "samples": samples}
    print(f"requests: {counts}")
    held = sorted(s["streams_open"] for s in under_load)
    if held:
        print(f"streams open at the samples: min {held[0]}, median {held[len(held) // 2]}, max {held[-1]}")
    print(f"{'process':10} {'rss MiB: base':>14} {'first':>7} {'last':>7} {'peak':>7} {'after':>7}   "
          f"{'fds: base':>9} {'peak':>5} {'after':>5}")
    for name in baseline:
        series = [s[name] for s in under_load if name in s]
        if not series or name not in after:
            continue
        print(f"{name:10} {baseline[name]['rss_mib']:>14} {series[0]['rss_mib']:>7} {series[-1]['rss_mib']:>7} "
              f"{max(s['rss_mib'] for s in series):>7} {after[name]['rss_mib']:>7}   {baseline[name]['fds']:>9} "
              f"{max(s['fds'] for s in series):>5} {after[name]['fds']:>5}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
