"""One client's hostile request beside another's small one: how much does it delay the probe?

    .venv/bin/python -m benchmarks.http_isolation [--probes 40] [--repeat 3] [--parse-workers 0,2] [--only TEXT]
                                                  [--out results/http_isolation.json]

A real gateway process (a nats-server of its own, no instance: generation requests end in a 503
after parsing and tokenizing, which is the work under test) with --max-body-bytes 8 MiB and a
64k-token context (the tiny test tokenizer: ~0.65 tokens per character of English). For each
scenario a probe client sends a small POST /tokenize (parsing, the tokenizer pool, a JSON answer)
every 10 ms on its keep-alive connection: first alone (the baseline), then while another
connection sends the hostile request (`--repeat` times). Prints the probe's latency (p50, max) alone and
beside it, the gateway's event-loop stalls alone and beside it (benchmarks/loop_stalls.py: how late a
1 ms timer woke, and the CPU time the loop itself spent meanwhile, which other load on the machine
does not inflate), and the hostile request's status and duration; writes them as JSON.

Each `--parse-workers` value is a gateway of its own, run in turn on the same scenarios:
0 parses every body on the event loop (as before body_workers), 2 (the default) parses bodies of
64 KiB or more in worker processes. `--only` keeps the scenarios whose name holds the text.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loop_stalls import read_stalls
from services.process_helpers import die_with_parent

MIB = 1024 * 1024
MAX_BODY = 8 * MIB
CONTEXT = 65_536  # tokens: a long-context model's


@dataclass(frozen=True)
class Scenario:
    name: str
    path: str
    body: bytes
    chunked: bool = False  # no Content-Length: the bound is counted while reading


def scenarios() -> list[Scenario]:
    hello = [{"role": "user", "content": "hello there " * 40}]
    return [
        Scenario("10 MB body, Content-Length (413)", "/v1/completions", json.dumps({"prompt": "x" * 10 * MIB}).encode()),
        Scenario("10 MB body, chunked (413 while read)", "/v1/completions",
                 json.dumps({"prompt": "x" * 10 * MIB}).encode(), chunked=True),
        Scenario("7 MB prompt (400: cannot fit, before tokenizing)", "/v1/completions",
                 json.dumps({"prompt": "word " * (7 * MIB // 5)}).encode()),
        Scenario("1.2M token ids as prompt (400)", "/v1/completions", json.dumps({"prompt": [7] * 1_200_000}).encode()),
        Scenario("1.2M ids in an unknown field (503)", "/v1/completions",
                 json.dumps({"prompt": "hi", "junk": [7] * 1_200_000}).encode()),
        Scenario("1.2M token ids to /detokenize (400: out of vocab)", "/detokenize",
                 json.dumps({"tokens": [1000] * 1_200_000}).encode()),
        Scenario("200k token ids detokenized (200)", "/detokenize", json.dumps({"tokens": [300] * 200_000}).encode()),
        Scenario("2 MB prompt to /tokenize (400: cannot fit)", "/tokenize",
                 json.dumps({"prompt": "word salad " * 190_000}).encode()),
        Scenario("~56k-token prompt tokenized (/tokenize)", "/tokenize",
                 json.dumps({"prompt": "word salad " * 8_000}).encode()),
        Scenario("4,096 short messages (template, tokenizer, 503)", "/v1/chat/completions",
                 json.dumps({"messages": [{"role": "user", "content": "hi"}] * 4096}).encode()),
        Scenario("200k stop strings (400)", "/v1/chat/completions",
                 json.dumps({"messages": hello, "stop": ["ab"] * 200_000}).encode()),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gateway_process(home: Path, parse_workers: int = 2) -> Iterator[tuple[int, Path]]:
    """A gateway on a port of its own, in front of a nats-server of its own (no instance):
    (its port, the log of its event loop's stalls: benchmarks/loop_stalls.py)."""
    from services.tools.make_model import build_tokenizer
    from shared.embedded_nats import start_nats

    model = home / "tiny-tok"
    build_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": CONTEXT}))
    nats = start_nats()
    port = _free_port()
    log = open(home / "gateway.log", "wb")
    stalls = home / f"stalls-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.loop_stalls", str(stalls),
                             "--model", str(model), "--nats-url", nats.url,
                             "--port", str(port), "--max-body-bytes", str(MAX_BODY), "--log-level", "warning",
                             "--body-parse-workers", str(parse_workers)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (home / "gateway.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the gateway did not start"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        yield port, stalls
        assert proc.poll() is None, "the gateway died:\n" + (home / "gateway.log").read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
        nats.stop()


def _send(port: int, scenario: Scenario) -> tuple[int, float]:
    """(In the hostile client's process: `--send`.) The hostile request on a connection of its
    own: (status, seconds)."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"}
        if scenario.chunked:
            step = 256 * 1024
            parts = (scenario.body[i:i + step] for i in range(0, len(scenario.body), step))
            connection.request("POST", scenario.path, body=parts, headers=headers, encode_chunked=True)
        else:
            connection.request("POST", scenario.path, body=scenario.body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status, time.perf_counter() - started
    except (ConnectionError, http.client.HTTPException):  # a 413 may close before the whole body is sent
        return 413, time.perf_counter() - started
    finally:
        connection.close()


class Probe:
    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.body = json.dumps({"prompt": "hello probe"}).encode()

    def once(self) -> float:
        started = time.perf_counter()
        self.connection.request("POST", "/tokenize", body=self.body, headers={"Content-Type": "application/json"})
        response = self.connection.getresponse()
        response.read()
        assert response.status == 200, response.status
        return time.perf_counter() - started

    def series(self, count: int, until: threading.Event | None = None) -> list[float]:
        latencies = []
        while len(latencies) < count or (until is not None and not until.is_set()):
            latencies.append(self.once())
            time.sleep(0.01)
        return latencies


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"n": len(ordered), "p50_ms": 1e3 * ordered[len(ordered) // 2],
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], "max_ms": 1e3 * ordered[-1]}


def measure(port: int, scenario: Scenario, probes: int, home: Path, stall_log: Path,
            repeat: int = 1) -> dict[str, object]:
    """The hostile client is a process of its own: in this one, its thread would take the GIL
    from the probe and count as the gateway's delay. It sends its request `repeat` times, one
    after another; the probe runs throughout (at least `probes` probes the first time). The
    gateway's event-loop stalls are read from its log for the same windows."""
    body = home / "hostile.body"
    body.write_bytes(scenario.body)
    probe = Probe(port)
    probe.series(5)  # warm
    alone_from = time.time()
    baseline = probe.series(probes)
    alone_stalls = read_stalls(stall_log, alone_from, time.time())
    beside: list[float] = []
    beside_stalls: list[tuple[float, float]] = []
    outcomes: list[tuple[int, float]] = []
    for attempt in range(repeat):
        done = threading.Event()
        outcome: list[str] = []

        def hostile() -> None:
            try:
                argv = [sys.executable, "-m", "benchmarks.http_isolation", "--send", str(body), "--port", str(port),
                        "--path", scenario.path] + (["--chunked"] if scenario.chunked else [])
                outcome.append(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
            finally:
                done.set()

        thread = threading.Thread(target=hostile)
        thread.start()
        beside += probe.series(probes if attempt == 0 else 0, until=done)
        thread.join()
        status_text, seconds_text, sent_text = outcome[0].split()
        outcomes.append((int(status_text), float(seconds_text)))
        time.sleep(0.05)  # the gateway's last stall line
        beside_stalls += read_stalls(stall_log, float(sent_text), float(sent_text) + float(seconds_text) + 0.05)
    probe.connection.close()
    statuses = {status for status, _ in outcomes}
    assert len(statuses) == 1, f"{scenario.name}: statuses differ between attempts: {outcomes}"
    return {"scenario": scenario.name, "status": outcomes[0][0], "hostile_s": max(s for _, s in outcomes),
            "repeat": repeat, "body_bytes": len(scenario.body), "baseline": _summary(baseline),
            "beside": _summary(beside), "loop_stalls_alone": _stall_summary(alone_stalls),
            "loop_stalls_beside": _stall_summary(beside_stalls)}


def _stall_summary(stalls: list[tuple[float, float]]) -> dict[str, float]:
    """The event loop's longest stall (ms late, over 2 ms) and the most CPU its thread spent in one."""
    return {"count": len(stalls), "max_wall_ms": max((w for w, _ in stalls), default=0.0),
            "max_cpu_ms": max((c for _, c in stalls), default=0.0)}


def run(probes: int, names: list[str] | None = None, parse_workers: int = 2,
        repeat: int = 1) -> list[dict[str, object]]:
    chosen = [s for s in scenarios() if names is None or s.name in names]
    with tempfile.TemporaryDirectory(prefix="corral-isolation-") as home, \
            gateway_process(Path(home), parse_workers) as (port, stall_log):
        rows = [measure(port, scenario, probes, Path(home), stall_log, repeat) for scenario in chosen]
    return [dict(row, parse_workers=parse_workers) for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=40, help="probes alone and (at least) beside, per scenario")
    parser.add_argument("--parse-workers", default="0,2",
                        help="comma-separated --body-parse-workers values, a gateway each (0: every body inline)")
    parser.add_argument("--only", help="the scenarios whose name holds this text")
    parser.add_argument("--repeat", type=int, default=3,
                        help="hostile requests per scenario, one after another (the probe's max is over all)")
    parser.add_argument("--out", default="results/http_isolation.json", help="(results/ is git-ignored)")
    parser.add_argument("--send", help=argparse.SUPPRESS)  # the hostile client: send this file's bytes
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--chunked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.send:
        body = Path(args.send).read_bytes()
        sent_at = time.time()
        status, seconds = _send(args.port, Scenario("", args.path, body, args.chunked))
        print(status, seconds, sent_at)
        return 0
    names = [s.name for s in scenarios() if args.only is None or args.only in s.name]
    rows = [row for workers in args.parse_workers.split(",")
            for row in run(args.probes, names, int(workers), args.repeat)]
    rows.sort(key=lambda row: (names.index(row["scenario"]), row["parse_workers"]))  # type: ignore[arg-type]
    print(f"{'scenario':50s} {'workers':>7} {'status':>6} {'took':>6}  probe p50/max ms, alone | beside   "
          "loop stall max wall/cpu ms, alone | beside")
    for row in rows:
        b, s = row["baseline"], row["beside"]
        la, lb = row["loop_stalls_alone"], row["loop_stalls_beside"]
        print(f"{row['scenario']:50s} {row['parse_workers']:>7} {row['status']:>6} {row['hostile_s']:5.2f}s  "  # type: ignore[index]
              f"{b['p50_ms']:5.1f} {b['max_ms']:6.1f} | {s['p50_ms']:5.1f} {s['max_ms']:6.1f}          "  # type: ignore[index]
              f"{la['max_wall_ms']:6.1f} {la['max_cpu_ms']:5.1f} | {lb['max_wall_ms']:6.1f} {lb['max_cpu_ms']:5.1f}")  # type: ignore[index]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"max_body_bytes": MAX_BODY, "context": CONTEXT, "repeat": args.repeat,
                               "runs": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
