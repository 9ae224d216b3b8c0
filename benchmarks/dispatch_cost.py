"""The scheduler's own cost per dispatch and per load report, without NATS: the scan
(`choose_instance` over every live instance, as before) against the `DispatchIndex`, side by side,
for fleets of N impersonated instances (benchmarks/fleet_impersonator.py's reports).

    .venv/bin/python -m benchmarks.dispatch_cost [--instances 16 100 1000 10000] [--out results/dispatch_cost.json]

Per dispatch: decide and account it (the scheduler's `decide`); per report: decode it and store it
(table + index). CPU time of this process (the machine's other load does not count); both
paths see the same reports and requests, and their decisions are checked to be the same.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks.fleet_impersonator import _FakeInstance
from shared.instance_table import InstanceTable
from shared.messages import DispatchRequest, LoadReport, decode
from shared.policy import PolicyConfig, account_dispatch, choose_instance
from shared.policy.dispatch_index import DispatchIndex

ROOT = Path(__file__).resolve().parent.parent


def _reports(n: int, rounds: int) -> list[bytes]:
    fleet = [_FakeInstance(f"fake-{i:05d}", random.Random(i)) for i in range(n)]
    headroom = dict(PolicyConfig().headroom_blocks)
    out = []
    for _ in range(rounds):
        for instance in fleet:
            instance.drift()
            out.append(instance.report(headroom, heartbeat_s=0.0))  # (0: every report is due, none skipped)
    return out


def measure(n: int, dispatches: int) -> dict:
    config = PolicyConfig()
    payloads = _reports(n, max(2, 20_000 // n))
    requests = [DispatchRequest(request_id=f"r{i}", num_prompt_tokens=64 + (i * 37) % 2000, max_tokens=128)
                for i in range(dispatches)]
    result = {"instances": n}
    decisions = {}
    for name in ("scan", "index"):
        index = DispatchIndex(config) if name == "index" else None
        table = InstanceTable(1e9, listener=index)
        started = time.process_time()
        for payload in payloads:
            table.update(decode(payload, LoadReport))
        result[f"{name}_report_us"] = 1e6 * (time.process_time() - started) / len(payloads)
        chosen = []
        started = time.process_time()
        for request in requests:
            decision = index.choose(request) if index is not None else choose_instance(table.live(), request, config)
            chosen.append(decision.instance_id)
            if decision.instance_id is not None:
                table.replace_load(account_dispatch(table.get(decision.instance_id), request))
        result[f"{name}_dispatch_us"] = 1e6 * (time.process_time() - started) / len(requests)
        decisions[name] = chosen
    result["same_decisions"] = decisions["scan"] == decisions["index"]
    # What one scheduler process spends at 20 reports/s per instance and 1,000 dispatches/s.
    for name in ("scan", "index"):
        result[f"{name}_cpu_per_s_at_20_reports_1000_dispatches"] = (
            20 * n * result[f"{name}_report_us"] + 1000 * result[f"{name}_dispatch_us"]) / 1e6
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, nargs="+", default=[16, 100, 1000, 10000])
    parser.add_argument("--dispatches", type=int, default=3000)
    parser.add_argument("--out", default=str(ROOT / "results" / "dispatch_cost.json"))
    args = parser.parse_args(argv)
    rows = [measure(n, args.dispatches) for n in args.instances]
    print(f"{'N':>6} {'scan us/disp':>12} {'index us/disp':>13} {'scan us/rep':>11} {'index us/rep':>12} "
          f"{'scan cpu s/s':>12} {'index cpu s/s':>13} same")
    for r in rows:
        print(f"{r['instances']:>6} {r['scan_dispatch_us']:>12.1f} {r['index_dispatch_us']:>13.1f} "
              f"{r['scan_report_us']:>11.1f} {r['index_report_us']:>12.1f} "
              f"{r['scan_cpu_per_s_at_20_reports_1000_dispatches']:>12.2f} "
              f"{r['index_cpu_per_s_at_20_reports_1000_dispatches']:>13.2f} {r['same_decisions']}")
    print("cpu s/s: one scheduler's decode+store and decide+account CPU at 20 reports/s per instance and "
          "1,000 dispatches/s (NATS client costs not included)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
