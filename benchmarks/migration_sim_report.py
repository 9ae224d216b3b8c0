"""What benchmarks/migration_sim.py prints and writes: one line per migration, the summary per length
(downtime against one decode step, client stall by phase, transfer against raw loopback,
recompute, the source's decode slowdown) and its goal checks."""

from __future__ import annotations

import dataclasses
import multiprocessing
import platform
import statistics
from typing import TYPE_CHECKING
from collections import defaultdict

from shared.messages import LoadReport
from benchmarks.raw_loopback import transfer_vs_raw, print_transfer_vs_raw
from benchmarks.client_stall import (
    attach_phases,
    phases_by_length,
    print_phases,
    stall_by_length,
    print_stalls,
)

if TYPE_CHECKING:
    from benchmarks.migration_sim import Settings


def report_line(kind: str, r: dict) -> None:
    during, before = r["src_steps_during"], r["src_steps_before"]
    step_note = ""
    if during.get("steps") and before.get("steps"):
        step_note = f" src step {before['mean_wall_ms']:.1f}→{during['mean_wall_ms']:.1f} ms"
    gbps = f"{r['first_stage_gbps']:.2f} GB/s" if r["first_stage_gbps"] else "-"
    for name, (before, after) in r.get("raw_loopback_gbps", {}).items():
        gbps += f" (raw {name} before/after {before:.2f}/{after:.2f})"
    print(f"{kind:>8} {r['length']:>5}: downtime {r['downtime_ms']:6.2f} ms, client stall {r['client_stall_ms']:6.1f} ms "
          f"(its ITL {r['own_itl_ms']:.1f}), {r['num_stages']} stages, stage 0 {gbps},{step_note}", flush=True)


def summarize(s: Settings, live: list, blocking: list, recompute: list, dst_report: LoadReport,
              workload: dict) -> dict:
    """`workload`: the benchmark's fixed background figures, recorded with the settings."""
    def by_length(rows: list, key: str) -> dict[int, float]:
        values: dict[int, list[float]] = defaultdict(list)
        for row in rows:
            values[row["length"]].append(row[key])
        return {length: statistics.median(v) for length, v in values.items()}

    attach_phases(live, s.out.with_suffix(".dst.log").read_text(errors="replace"))
    live_down = by_length(live, "downtime_ms")
    shortest, longest = min(s.lengths), max(s.lengths)
    longest_live = [r for r in live if r["length"] == longest]
    transfer = statistics.median(r["first_stage_gbps"] or 0 for r in longest_live)
    transfer_vs_raw_by_link = transfer_vs_raw(longest_live)
    transfer_ratio = transfer_vs_raw_by_link["in_destination"]["median"]

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
        "settings": {**dataclasses.asdict(s), "out": str(s.out), **workload,
                     "destination_kv_address": dst_report.kv_address},
        # in_destination: the like-for-like baseline (goals); own_process: an idle receiver.
        "transfer_over_raw_loopback": transfer_vs_raw_by_link,
        "live_downtime_ms_by_length": live_down,
        "blocking_downtime_ms_by_length": by_length(blocking, "downtime_ms"),
        "recompute_ttft_ms_by_length": recompute_ms,
        "live_stages_by_length": by_length(live, "num_stages"),
        "live_last_stage_kib_by_length": by_length(live, "last_stage_kib"),
        "live_client_stall_ms_by_length": stall_by_length(live),
        "live_stall_phases_ms_by_length": phases_by_length(live),
        "modelled_decode_step_ms": modelled_step,
        "src_step_ms": {"before_migration": step_before, "during_migration": step_during},
        "transfer_gbps_longest_first_stage": transfer,
        "goals": goals,
        "runs": {"live": live, "blocking": blocking, "recompute": recompute},
    }


def print_summary(result: dict) -> None:
    print(f"\nlength  live(ms)  stages  last stage(KiB)  blocking(ms)  recompute(ms)   "
          f"[token frames: {result['settings']['limits']['token_frames']}, "
          f"notice steps: {result['settings']['limits'].get('notice_steps')}]")
    for length in result["settings"]["lengths"]:
        print(f"{length:>6}  {result['live_downtime_ms_by_length'][length]:8.2f}  "
              f"{result['live_stages_by_length'][length]:6.1f}  "
              f"{result['live_last_stage_kib_by_length'][length]:15.1f}  "
              f"{result['blocking_downtime_ms_by_length'][length]:12.1f}  "
              f"{result['recompute_ttft_ms_by_length'][length]:13.1f}")
    print_stalls(result["live_client_stall_ms_by_length"])
    print_phases(result["live_stall_phases_ms_by_length"])
    before, during = result["src_step_ms"]["before_migration"], result["src_step_ms"]["during_migration"]
    print(f"modelled A10 decode step of the source batch: {result['modelled_decode_step_ms']:.1f} ms")
    if before.get("steps") and during.get("steps"):
        print(f"source decode steps, wall (modelled) ms: before migration {before['mean_wall_ms']:.2f} "
              f"({before['mean_modelled_ms']:.2f}, {before['steps']} steps), during {during['mean_wall_ms']:.2f} "
              f"({during['mean_modelled_ms']:.2f}, {during['steps']} steps)")
    print(f"transfer (longest, stage 0, median): {result['transfer_gbps_longest_first_stage']:.2f} GB/s")
    print_transfer_vs_raw(result["transfer_over_raw_loopback"])
    for name, value in result["goals"].items():
        print(f"  {name}: {value:.2f}" if value is not None else f"  {name}: -")
