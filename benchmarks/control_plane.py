"""Control plane at fleet scale: a real scheduler and gateway over a real nats-server, N llumlets
impersonated (benchmarks/fleet_impersonator.py: real subjects, real report builder, 20 reports/s each).

For each N it measures, side by side:
- dispatch round trip P50/P99 (request/reply on the scheduler's dispatch subject, open loop at
  --rate dispatches/s, from a process of its own) and the rate achieved;
- the scheduler's CPU seconds per second and the load reports delivered to it per second
  (nats-server's /connz for its connection);
- NATS messages per streamed request through the gateway's HTTP API, load reports excluded
  (nats-server's /varz in and out counts, less the impersonators' reports and their fan-out);
- the gateway's CPU per streamed token (and its CPU while idle: the load reports alone);
- with --fan-in-streams, token fan-in: chunk messages/s and gateway CPU per token with one NATS
  message per chunk, then one TokenChunkBatch per gateway per engine step.

Rows labelled `current` impersonate this tree's llumlets (step chunks batched per gateway); rows
from --scheduler-root impersonate the llumlets of before (one message per chunk).

Every process's CPU share is printed, the impersonators' and the clients' too: this machine's
cores are shared, so a slow figure may be the load generator's, not the control plane's.

    .venv/bin/python -m benchmarks.control_plane --instances 16 100 1000 --seconds 5
    .venv/bin/python -m benchmarks.control_plane --instances 1000 --scheduler-replicas 1 2 3 \
        --report-heartbeat-s 0 0.25 --drift-share 0.2     (the scale-out curve; reports only on change)

Writes results/control_plane.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.control_plane_cluster import ROOT, in_child, Cluster, Fleet, Window, percentile


# ------------------------------------------------------------------------------- clients


# ------------------------------------------------------------------------------- the cluster


def measure(n: int, replicas: int, heartbeat_s: float, args: argparse.Namespace, model_dir: str, log_dir: Path,
            scheduler: str, root: Path) -> dict:
    cluster = Cluster(model_dir, log_dir, args.scheduler_arg, root, replicas)
    processes = args.impersonators or (1 if n <= 200 else 2)
    fleet = Fleet(cluster.nats_url, n, processes, args.step_s, heartbeat_s, args.drift_share)
    fleet.set_batching(scheduler == "current")  # this tree's llumlets batch a step's chunks per gateway; older ones did not
    try:
        time.sleep(2.0)  # every instance reported; the scheduler's table is full
        idle = Window(cluster, fleet)
        time.sleep(args.seconds)
        idle_stats = idle.close()

        window = Window(cluster, fleet)
        (latencies, achieved, failures), client_cpu = in_child("dispatch", (cluster.nats_url, args.rate, args.seconds))
        dispatch = window.close()
        dispatch["client_cpu_per_s"] = client_cpu / dispatch["seconds"]

        window = Window(cluster, fleet)
        (done, tokens, stream_failures), stream_client_cpu = in_child(
            "stream", (cluster.base_url, cluster.model, args.streams, args.seconds, args.max_tokens))
        stream = window.close()
        stream["client_cpu_per_s"] = stream_client_cpu / stream["seconds"]
    finally:
        fleet.stop()
        cluster.stop()

    reports_per_s = idle_stats["reports_published"] / idle_stats["seconds"]
    delivered_per_s = idle_stats["scheduler_delivered"] / idle_stats["seconds"]
    # Report traffic in the streaming window: each report in once, out to the scheduler and the gateway.
    stream_reports = stream["reports_published"]
    per_request_in = (stream["nats_in"] - stream_reports) / max(done, 1)
    per_request_out = (stream["nats_out"] - 2 * stream_reports) / max(done, 1)
    gateway_idle = idle_stats["cpu_per_s"]["gateway"]
    gateway_stream = stream["cpu_per_s"]["gateway"]
    tokens_per_s = tokens / stream["seconds"]
    return {
        "scheduler": scheduler,
        "scheduler_replicas": replicas,
        "report_heartbeat_s": heartbeat_s,
        "drift_share": args.drift_share,
        "instances": n,
        "impersonator_processes": processes,
        "reports_per_s_published": reports_per_s,
        "reports_per_s_delivered_to_scheduler": delivered_per_s,
        "dispatch": {
            "target_per_s": args.rate, "achieved_per_s": achieved, "answered": len(latencies), "failures": failures,
            "p50_ms": 1e3 * percentile(latencies, 0.5), "p99_ms": 1e3 * percentile(latencies, 0.99),
            "max_ms": 1e3 * max(latencies, default=float("nan")),
        },
        "scheduler_cpu_per_s": {"idle": idle_stats["cpu_per_s"]["scheduler"],
                                "dispatching": dispatch["cpu_per_s"]["scheduler"]},
        "nats_messages_per_streamed_request": {"in": per_request_in, "out": per_request_out,
                                               "tokens_per_request": tokens / max(done, 1)},
        "gateway": {
            "cpu_per_s_idle": gateway_idle, "cpu_per_s_streaming": gateway_stream,
            "streams": args.streams, "requests": done, "failures": stream_failures, "tokens_per_s": tokens_per_s,
            "cpu_us_per_token": 1e6 * gateway_stream / max(tokens_per_s, 1e-9),
            "cpu_us_per_token_net_of_idle": 1e6 * (gateway_stream - gateway_idle) / max(tokens_per_s, 1e-9),
        },
        "cpu_share_per_s": {"idle": {**idle_stats["cpu_per_s"], "impersonators": idle_stats["impersonators_cpu_per_s"]},
                            "dispatching": {**dispatch["cpu_per_s"], "impersonators": dispatch["impersonators_cpu_per_s"],
                                            "client": dispatch["client_cpu_per_s"]},
                            "streaming": {**stream["cpu_per_s"], "impersonators": stream["impersonators_cpu_per_s"],
                                          "client": stream["client_cpu_per_s"]}},
        "machine_cpus": os.cpu_count(),
    }


def measure_fan_in(args: argparse.Namespace, model_dir: str, log_dir: Path) -> list[dict]:
    """Token fan-in at --fan-in-streams concurrent streams: the impersonated llumlets send one
    message per chunk (as before TokenChunkBatch), then one per gateway per step."""
    cluster = Cluster(model_dir, log_dir, args.scheduler_arg, ROOT)
    fleet = Fleet(cluster.nats_url, args.fan_in_instances, 1, args.step_s)
    rows = []
    try:
        time.sleep(2.0)
        for batching in args.fan_in_order:
            fleet.set_batching(batching)
            window = Window(cluster, fleet)
            (done, tokens, failures), client_cpu = in_child(
                "stream", (cluster.base_url, cluster.model, args.fan_in_streams, args.seconds, args.fan_in_tokens))
            w = window.close()
            rows.append({
                "batching": batching, "instances": args.fan_in_instances, "streams": args.fan_in_streams,
                "requests": done, "failures": failures, "tokens_per_s": tokens / w["seconds"],
                "chunks_per_s": w["chunks_published"] / w["seconds"],
                "chunk_messages_per_s": w["chunk_messages_published"] / w["seconds"],
                "nats_in_per_s": w["nats_in"] / w["seconds"],
                "gateway_cpu_per_s": w["cpu_per_s"]["gateway"],
                "gateway_cpu_us_per_token": 1e6 * w["cpu_per_s"]["gateway"] * w["seconds"] / max(tokens, 1),
                "impersonator_cpu_per_s": w["impersonators_cpu_per_s"], "client_cpu_per_s": client_cpu / w["seconds"],
            })
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        fleet.stop()
        cluster.stop()
    print(f"fan-in: {args.fan_in_streams} streams on {args.fan_in_instances} instances, {args.fan_in_tokens} tokens each")
    print(f"{'batching':>8} {'tokens/s':>9} {'chunks/s':>9} {'chunk msg/s':>11} {'gw cpu s/s':>10} {'gw us/tok':>9} "
          f"{'client':>6} {'imp':>5}")
    for r in rows:
        print(f"{str(r['batching']):>8} {r['tokens_per_s']:>9.0f} {r['chunks_per_s']:>9.0f} {r['chunk_messages_per_s']:>11.0f} "
              f"{r['gateway_cpu_per_s']:>10.2f} {r['gateway_cpu_us_per_token']:>9.0f} {r['client_cpu_per_s']:>6.2f} "
              f"{r['impersonator_cpu_per_s']:>5.2f}")
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'scheduler':>10} {'N':>5} {'repl':>4} {'beat s':>6} {'rep/s pub':>9} {'rep/s sch':>9} {'disp/s':>7} {'P50 ms':>7} {'P99 ms':>7} "
          f"{'sched cpu':>9} {'msg/req':>8} {'gw us/tok':>9} {'gw idle':>7} {'imp cpu':>7} {'client':>6}")
    for r in rows:
        d, share = r["dispatch"], r["cpu_share_per_s"]["dispatching"]
        print(f"{r['scheduler']:>10} {r['instances']:>5} {r['scheduler_replicas']:>4} {r['report_heartbeat_s']:>6.2f} "
              f"{r['reports_per_s_published']:>9.0f} {r['reports_per_s_delivered_to_scheduler']:>9.0f} "
              f"{d['achieved_per_s']:>7.0f} {d['p50_ms']:>7.3f} {d['p99_ms']:>7.3f} "
              f"{r['scheduler_cpu_per_s']['dispatching']:>9.2f} "
              f"{r['nats_messages_per_streamed_request']['in']:>8.1f} {r['gateway']['cpu_us_per_token']:>9.0f} "
              f"{r['gateway']['cpu_per_s_idle']:>7.2f} {share['impersonators']:>7.2f} {share['client']:>6.2f}")
    print("repl: scheduler replicas (a queue group); beat s: reports only on change with this heartbeat (0: every "
          "50 ms); rep/s pub: reports the impersonators published; rep/s sch: delivered to the scheduler; sched cpu: "
          "scheduler CPU s/s while dispatching; msg/req: NATS messages published per streamed request (reports "
          "excluded); gw us/tok: gateway CPU per streamed token; gw idle: gateway CPU s/s from reports alone; "
          "imp cpu / client: the load generators' CPU s/s during the dispatch phase")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, nargs="+", default=[16, 100, 1000])
    parser.add_argument("--rate", type=float, default=1000.0, help="dispatches per second (open loop)")
    parser.add_argument("--seconds", type=float, default=5.0, help="each phase's length")
    parser.add_argument("--streams", type=int, default=50, help="concurrent streaming HTTP clients")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per streamed request")
    parser.add_argument("--step-s", type=float, default=0.02, help="the impersonated engines' step time")
    parser.add_argument("--impersonators", type=int, default=0, help="processes for the fake fleet (0: 1, 2 past 200)")
    parser.add_argument("--scheduler-arg", action="append", default=[], help="passed to `corral scheduler`")
    parser.add_argument("--scheduler-root", action="append", default=[], metavar="LABEL=DIR",
                        help="also run the scheduler from DIR (e.g. `git archive <commit> | tar -x -C DIR`), "
                             "side by side with this tree's (labelled 'current')")
    parser.add_argument("--scheduler-replicas", type=int, nargs="+", default=[1],
                        help="scheduler processes (a queue group on the dispatch subject, each with the full table; "
                             "their CPU is summed); several values: a row each (the scale-out curve)")
    parser.add_argument("--report-heartbeat-s", type=float, nargs="+", default=[0.0],
                        help="the fleet's reports only on change with this heartbeat (the llumlets' "
                             "--report-heartbeat-s; 0: every 50 ms, 20 reports/s an instance); several: a row each")
    parser.add_argument("--drift-share", type=float, default=1.0,
                        help="the share of instances whose load moves in each 50 ms (with a heartbeat, the rest "
                             "send nothing new until their own requests come and go)")
    parser.add_argument("--fan-in-streams", type=int, default=0,
                        help="also measure token fan-in at this many concurrent streams, batching off then on")
    parser.add_argument("--fan-in-instances", type=int, default=16)
    parser.add_argument("--fan-in-order", type=lambda text: [part == "batched" for part in text.split(",")],
                        default=[False, True], help="phases in order, e.g. batched,unbatched (default unbatched,batched)")
    parser.add_argument("--log-dir", default="", help="keep the fan-in cluster's logs here")
    parser.add_argument("--fan-in-tokens", type=int, default=64)
    parser.add_argument("--label", default="", help="kept in the JSON")
    parser.add_argument("--out", default=str(ROOT / "results" / "control_plane.json"))
    args = parser.parse_args(argv)

    from services.tools.make_model import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_tiny_model(model_dir, seed=0)
        roots = [tuple(item.split("=", 1)) for item in args.scheduler_root] + [("current", str(ROOT))]
        for n in args.instances:
            for replicas in args.scheduler_replicas:
                for heartbeat_s in args.report_heartbeat_s:
                    for label, root in roots:  # (the scheduler from the tree given runs from it; the rest from here)
                        log_dir = Path(tmp) / f"logs-{label}-{n}-{replicas}-{heartbeat_s}"
                        log_dir.mkdir()
                        rows.append(measure(n, replicas, heartbeat_s, args, str(model_dir), log_dir, label, Path(root)))
                        print(json.dumps(rows[-1]), file=sys.stderr)
        print_table(rows)
        fan_in_logs = Path(args.log_dir or tmp)
        fan_in_logs.mkdir(parents=True, exist_ok=True)
        fan_in = measure_fan_in(args, str(model_dir), fan_in_logs) if args.fan_in_streams else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "args": vars(args), "rows": rows, "fan_in": fan_in}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
