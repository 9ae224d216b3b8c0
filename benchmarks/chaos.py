"""The fault table (issue 14): each fault under a standard load, as a client and an operator see it.

For every fault a fresh NATS and a fresh cluster of real processes (sim engine: `--instances`
llumlets, a scheduler, a gateway; two schedulers or two gateways where the fault needs them) run
`--streams` concurrent streams of `--tokens` tokens; once they are mid-decode the fault strikes.
New requests keep arriving during the fault (one every 100 ms for `--probe-s`). Per fault:

- sent / completed / resumed / failed / hung: the in-flight streams (resumed: re-placed on
  another instance by the gateway after their instance was lost; failed: ended with an error the
  client saw; hung: no end within 60 s), and `wrong`: completed with output other than the
  simulator's stream for that request.
- errors: every client-visible error, in-flight streams and new requests together.
- stall P50/P99: for each stream in flight at the fault, the gap from its last token before the
  fault to its next one (the client-visible recovery; resume time for a lost instance).
- new TTFT P50/P99 and new failed: the requests that arrived during the fault.
- leaked blocks: KV blocks not free on the live instances once everything ended (10 s allowed).

A gateway kill takes the victim gateway's own streams with it (their clients' connections drop,
counted apart as `victim_streams`); what it measures is the other gateway's streams and how long
the victim's requests keep decoding on the engines (`orphans_cleared_s`).

Usage: .venv/bin/python -m benchmarks.chaos [--faults a,b] [--streams 32] [--tokens 300]
Writes results/chaos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shared.embedded_nats import start_nats
from tests.chaos.harness import SIM_ARGS, GenerateLog, SimOutput, log_lines
from tests.chaos.test_nats_cluster import start_nats_cluster
from tests.support.cluster import Cluster, free_port
from tests.support.observer import NatsObserver

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 60.0
FAULTS = ["none", "llumlet-sigkill", "llumlet-sigterm", "nats-outage-5s", "scheduler-sigkill", "scheduler-sigstop",
          "gateway-kill", "nats-node-loss"]
VICTIM = "sim-1"


@dataclass
class Stream:
    prompt: list[int]
    started: float = 0.0
    times: list[float] = field(default_factory=list)  # each token event's arrival
    text: str = ""
    request_id: str = ""
    finish: str | None = None
    error: str | None = None
    hung: bool = False

    @property
    def completed(self) -> bool:
        return self.finish is not None and self.error is None


async def run_stream(http: httpx.AsyncClient, model: str, prompt: list[int], tokens: int,
                     stream: Stream | None = None) -> Stream:
    """One streamed completion, recorded into `stream` as its events arrive."""
    stream = stream or Stream(prompt)
    stream.started = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    try:
        async with asyncio.timeout(HANG_S):
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    stream.error = f"HTTP {reply.status_code}"
                    return stream
                buffer = b""
                async for data in reply.aiter_bytes():
                    buffer += data
                    *frames, buffer = buffer.split(b"\n\n")
                    for frame in frames:
                        if not frame.startswith(b"data: {"):
                            continue
                        event = json.loads(frame[6:])
                        if "error" in event:
                            stream.error = event["error"]["message"]
                            continue
                        stream.request_id = event["id"]
                        stream.times.append(time.monotonic())
                        for choice in event["choices"]:
                            stream.text += choice["text"]
                            stream.finish = choice["finish_reason"] or stream.finish
    except TimeoutError:
        stream.hung = True
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream


def prompts(n: int, salt: int = 0) -> list[list[int]]:
    return [[1 + (i * 7 + j + salt * 13) % 200 for j in range(16 + i % 5)] + [201 + salt] for i in range(n)]


def percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    ordered = sorted(values)
    return round(statistics.median(ordered) * 1000, 1), round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1)


class Run:
    """One fault: its cluster, and how to strike (and heal) it."""

    def __init__(self, fault: str, args: argparse.Namespace, model_dir: Path, work: Path) -> None:
        self.fault, self.args, self.model_dir = fault, args, model_dir
        self.log_dir = work / f"logs-{fault}"
        self.log_dir.mkdir()
        if fault == "nats-node-loss":
            (work / f"nats-{fault}").mkdir()
            self.servers = start_nats_cluster(work / f"nats-{fault}")
        else:
            self.servers = [start_nats()]
        self.cluster = Cluster(",".join(s.url for s in self.servers), model_dir, self.log_dir)
        self.instances = [f"sim-{i}" for i in range(args.instances)]
        self.victim_url: str | None = None

    def start(self) -> None:
        cluster = self.cluster
        if self.fault == "scheduler-sigkill":
            for sid in ("a", "b"):
                cluster.spawn(f"scheduler-{sid}", "scheduler", "--scheduler-id", sid)
        else:
            cluster.start_scheduler()
        for instance in self.instances:
            cluster.start_llumlet(instance, *SIM_ARGS)
        cluster.start_gateway()
        if self.fault == "gateway-kill":
            port = free_port()
            cluster.spawn("gateway-2", "gateway", "--model", str(self.model_dir), "--port", str(port),
                          "--gateway-id", "gw-victim")
            self.victim_url = f"http://127.0.0.1:{port}"
        cluster.wait_ready(instances=len(self.instances))
        if self.victim_url:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{self.victim_url}/healthz", timeout=1).json().get("instances", 0) >= len(self.instances):
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.2)

    async def strike(self) -> Callable[[], None] | None:
        """Inject the fault; returns what heals it later (None: nothing to heal)."""
        procs, fault = self.cluster.procs, self.fault
        if fault == "llumlet-sigkill":
            procs[VICTIM].process.kill()
        elif fault == "llumlet-sigterm":
            procs[VICTIM].process.send_signal(signal.SIGTERM)
        elif fault == "scheduler-sigkill":
            procs["scheduler-a"].process.kill()
        elif fault == "scheduler-sigstop":
            pid = procs["scheduler"].process.pid
            os.kill(pid, signal.SIGSTOP)
            return lambda: os.kill(pid, signal.SIGCONT)
        elif fault == "gateway-kill":
            procs["gateway-2"].process.kill()
        elif fault == "nats-node-loss":
            self.servers[1].process.kill()
        elif fault == "nats-outage-5s":
            port = self.servers[0].port
            self.servers[0].stop()

            def revive() -> None:
                self.servers[0] = start_nats(port=port)
            return revive
        return None

    @property
    def live_instances(self) -> list[str]:
        return [i for i in self.instances if self.cluster.procs[i].alive()]

    def stop(self) -> None:
        for proc in self.cluster.procs.values():
            if proc.alive():
                try:
                    os.kill(proc.process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.cluster.stop()
        for server in self.servers:
            server.stop()


async def measure(run: Run, args: argparse.Namespace) -> dict:
    cluster, tokens = run.cluster, args.tokens
    monitor_url = run.servers[0].url
    name = httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]
    limits = httpx.Limits(max_connections=None)
    own_prompts = prompts(args.streams)
    victim_prompts = prompts(args.streams // 2, salt=1) if run.victim_url else []
    if run.victim_url:
        own_prompts = own_prompts[: args.streams - len(victim_prompts)]
    row: dict = {"fault": run.fault}
    async with NatsObserver(monitor_url) as observer, GenerateLog(monitor_url) as generated, \
            httpx.AsyncClient(base_url=cluster.base_url, timeout=HANG_S, limits=limits) as http, \
            httpx.AsyncClient(base_url=run.victim_url or cluster.base_url, timeout=HANG_S, limits=limits) as victim_http:
        watched = [Stream(p) for p in own_prompts]
        tasks = [asyncio.create_task(run_stream(http, name, s.prompt, tokens, s)) for s in watched]
        victim_tasks = [asyncio.create_task(run_stream(victim_http, name, p, tokens * 4)) for p in victim_prompts]
        victim_matters = run.fault.startswith("llumlet")
        row["loaded_at_fault"] = await observer.wait_for(
            lambda latest: sum(r.num_running for r in latest.values()) >= args.streams // 2
            and (not victim_matters or (VICTIM in latest and latest[VICTIM].num_running >= 4)), 30)
        deadline = time.monotonic() + 30
        while sum(len(s.times) >= 10 for s in watched) < 3 * len(watched) // 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # mid-decode: most streams have tokens, none is near its end
        row["loaded_at_fault"] = row["loaded_at_fault"] and time.monotonic() < deadline
        struck = time.monotonic()
        heal = await run.strike()
        # New requests during the fault, and the victim gateway's orphans leaving the engines.
        new: list[asyncio.Task] = []
        orphans_cleared = None
        healed = False
        while time.monotonic() - struck < args.probe_s or (heal and not healed):
            if heal and not healed and time.monotonic() - struck >= args.fault_s:
                await asyncio.to_thread(heal)
                healed = True
            if time.monotonic() - struck < args.probe_s:
                new.append(asyncio.create_task(run_stream(http, name, prompts(1, salt=2 + len(new))[0], 20)))
            if run.victim_url and orphans_cleared is None:
                left = sum(not t.done() for t in tasks) + sum(1 for t in new if not t.done())
                if sum(r.num_running + r.num_waiting for r in observer.latest.values()) <= left:
                    orphans_cleared = time.monotonic() - struck
            await asyncio.sleep(0.1)
        streams = await asyncio.gather(*tasks)
        new_streams = await asyncio.gather(*new)
        victim_streams = await asyncio.gather(*victim_tasks)
        resumed_ids = {order.request_id for order in generated.resumes}
        sim = SimOutput(run.model_dir)
        wrong = 0
        for stream in streams:
            if stream.completed:
                request_id = generated.request_id(stream.prompt)
                wrong += stream.text != sim.text(request_id, stream.prompt, tokens)
        sim.tokenizer.close()
        request_ids = {generated.request_id(s.prompt) for s in streams}
    stalls = []
    for stream in streams:
        before = [t for t in stream.times if t <= struck]
        after = [t for t in stream.times if t > struck]
        if before and after and not (stream.finish and stream.times[-1] <= struck):
            stalls.append(after[0] - before[-1])
    row["in_flight_at_fault"] = sum(1 for s in streams if any(t <= struck for t in s.times)
                                    and any(t > struck for t in s.times))
    leaked = await leaked_blocks(monitor_url if run.fault != "nats-outage-5s" else run.servers[0].url, run.live_instances)
    new_ttft = [s.times[0] - s.started for s in new_streams if s.times]
    row.update({
        "sent": len(streams),
        "completed": sum(s.completed for s in streams),
        "resumed": len(resumed_ids & request_ids),
        "failed": sum(s.error is not None and not s.hung for s in streams),
        "hung": sum(s.hung for s in streams),
        "wrong": wrong,
        "errors": sum(s.error is not None for s in streams) + sum(s.error is not None for s in new_streams),
        "stall_ms_p50_p99": percentiles(stalls),
        "new_sent": len(new_streams),
        "new_failed": sum(not s.completed for s in new_streams),
        "new_ttft_ms_p50_p99": percentiles(new_ttft),
        "leaked_blocks": leaked,
        "error_samples": sorted({s.error for s in [*streams, *new_streams] if s.error})[:3],
    })
    if run.victim_url:
        row["victim_streams"] = len(victim_streams)
        row["orphans_cleared_s"] = None if orphans_cleared is None else round(orphans_cleared, 2)
    row["silent_logs"] = {name: len(log_lines(cluster, name, "went silent")) for name in run.instances} \
        if run.fault == "gateway-kill" else None
    return row


async def leaked_blocks(nats_url: str, instances: list[str], timeout_s: float = 10.0) -> int | None:
    """Blocks not free on the live instances once everything ended (None: no report heard)."""
    try:
        async with NatsObserver(nats_url) as observer:
            def idle(latest) -> bool:
                return all(i in latest and latest[i].num_blocks_free == latest[i].num_blocks_total for i in instances)

            await observer.wait_for(idle, timeout_s)
            if not all(i in observer.latest for i in instances):
                return None
            return sum(observer.latest[i].num_blocks_total - observer.latest[i].num_blocks_free for i in instances)
    except Exception:  # (NATS not reachable from here)
        return None


COLUMNS = [("fault", 18), ("sent", 5), ("compl", 6), ("resum", 6), ("fail", 5), ("hung", 5), ("wrong", 6),
           ("errors", 7), ("stall p50/p99 ms", 18), ("new ok/sent", 12), ("new ttft p50/p99", 18), ("leaked", 7)]


def table_line(row: dict) -> str:
    def pair(p) -> str:
        return "-" if p[0] is None else f"{p[0]:.0f}/{p[1]:.0f}"

    cells = [row["fault"], row["sent"], row["completed"], row["resumed"], row["failed"], row["hung"], row["wrong"],
             row["errors"], pair(row["stall_ms_p50_p99"]), f"{row['new_sent'] - row['new_failed']}/{row['new_sent']}",
             pair(row["new_ttft_ms_p50_p99"]), "?" if row["leaked_blocks"] is None else row["leaked_blocks"]]
    return " ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=300, help="per stream (10 ms a step: ~3 s of decoding)")
    parser.add_argument("--probe-s", type=float, default=3.0, help="send new requests this long after the fault")
    parser.add_argument("--fault-s", type=float, default=5.0, help="how long a healable fault lasts (NATS, SIGSTOP)")
    parser.add_argument("--out", default=str(ROOT / "results" / "chaos.json"))
    parser.add_argument("--keep-logs", default="", metavar="DIR", help="copy every process's log here")
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if unknown := set(faults) - set(FAULTS):
        raise SystemExit(f"unknown faults: {', '.join(sorted(unknown))}")
    assert args.streams >= 1 and args.instances >= 2

    from services.tools.make_model import make_tiny_model

    rows = []
    print(" ".join(name.ljust(w) for name, w in COLUMNS))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_tiny_model(model_dir, seed=0)
        for fault in faults:
            run = Run(fault, args, model_dir, Path(tmp))
            started = time.monotonic()
            try:
                run.start()
                row = asyncio.run(measure(run, args))
            except Exception as exc:  # one fault's failure to run is a row, not the end of the table
                row = {"fault": fault, "error": f"{type(exc).__name__}: {exc}"}
            finally:
                run.stop()
                if args.keep_logs:
                    shutil.copytree(run.log_dir, Path(args.keep_logs) / fault, dirs_exist_ok=True)
            row["wall_s"] = round(time.monotonic() - started, 1)
            rows.append(row)
            print(table_line(row) if "error" not in row else f"{fault.ljust(18)} did not run: {row['error']}", flush=True)
            for sample in row.get("error_samples") or []:
                print(f"{'':18} error: {sample[:150]}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
