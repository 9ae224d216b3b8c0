"""What benchmarks/migration_vllm.py prints and writes: one line per migration, the summary per
length (downtime, client stall by phase, transfer against raw loopback, recompute, the source's
decode slowdown) and its checks."""

from __future__ import annotations

import dataclasses
import multiprocessing
import platform
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.client_stall import (
    attach_phases,
    phases_by_length,
    print_phases,
    print_stalls,
    stall_by_length,
)
from benchmarks.raw_loopback import print_transfer_vs_raw, transfer_vs_raw
from shared.messages import LoadReport

if TYPE_CHECKING:
    from benchmarks.migration_vllm import Settings


def report_line(kind: str, r: dict) -> None:
    during, before = r["src_steps_during"], r["src_steps_before"]
    step_note = ""
    if during.get("steps") and before.get("steps"):
        step_note = f", src step {before['median_ms']:.2f}→{during['median_ms']:.2f} ms"
    gbps = f"{r['first_stage_gbps']:.2f} GB/s" if r["first_stage_gbps"] else "-"
    commit = f"copy+commit in frame {r['commit_ms']:.2f} [{r['final_blocks']} blocks]"
    commit += " + NATS fallback" if r["commit_via"] != "frame" else ""
    print(f"{kind:>8} {r['length']:>5}: downtime {r['downtime_ms']:6.2f} ms (top-up {r['final_prealloc_ms']:.2f}, "
          f"{commit}), "
          f"client stall {r['client_stall_ms']:6.1f} ms (its ITL {r['own_itl_ms']:.1f}), {r['num_stages']} stages, "
          f"stage 0 {gbps}{step_note}", flush=True)


def summarize(s: Settings, live: list, blocking: list, recompute: list, dst_report: LoadReport, src,
              dst_log: Path, workload: dict) -> dict:
    """`workload`: the benchmark's fixed background and warm-up figures, recorded with the settings."""
    attach_phases(live + blocking, dst_log.read_text(errors="replace"))

    def by_length(rows: list, key) -> dict[int, float]:
        values: dict[int, list[float]] = defaultdict(list)
        for row in rows:
            value = key(row) if callable(key) else row[key]
            if value is not None:
                values[row["length"]].append(value)
        return {length: statistics.median(v) for length, v in values.items()}

    def median(rows: list, key) -> float | None:
        values = [v for row in rows if (v := (key(row) if callable(key) else row[key])) is not None]
        return statistics.median(values) if values else None

    shortest, longest = min(s.lengths), max(s.lengths)
    live_down = by_length(live, "downtime_ms")
    recompute_ms = by_length(recompute, "ttft_ms")
    longest_live = [r for r in live if r["length"] == longest]
    transfer = median(longest_live, "first_stage_gbps")
    transfer_vs_raw_by_link = transfer_vs_raw(longest_live)
    step_ratios = [r["src_steps_during"]["median_ms"] / r["src_steps_before"]["median_ms"]
                   for r in live if r["src_steps_during"].get("steps") and r["src_steps_before"].get("steps")]
    breakdown_keys = ("downtime_ms", "final_prealloc_ms", "before_commit_ms", "final_copy_ms", "commit_ms",
                      "suspend_ms", "release_ms", "downtime_to_release_ms", "client_stall_ms", "own_itl_ms")
    breakdown = {key: median(live, key) for key in breakdown_keys}
    goals = {
        "downtime_max_median_ms": max(live_down.values()),
        "downtime_flat_longest_over_shortest": live_down[longest] / live_down[shortest],
        "recompute_over_live_at_longest": recompute_ms[longest] / live_down[longest],
        "transfer_over_raw_loopback": transfer_vs_raw_by_link["in_destination"]["median"],
        "src_decode_step_slowdown_during_migration": statistics.median(step_ratios) if step_ratios else None,
    }
    return {
        "machine": {"cpus": multiprocessing.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "settings": {**dataclasses.asdict(s), "out": str(s.out), "model_dir": str(s.model_dir),
                     **workload, "block_size": src.engine.block_size,
                     "num_blocks": src.engine.num_blocks_total, "block_bytes": src.migration.copier.block_bytes,
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
        "live_final_copy_ms_by_length": by_length(live, "final_copy_ms"),
        "live_commit_ms_by_length": by_length(live, "commit_ms"),
        "commit_via": dict(Counter(r["commit_via"] for r in live)),
        "src_step_ms": {"before_migration": median(live, lambda r: r["src_steps_before"].get("median_ms")),
                        "during_migration": median(live, lambda r: r["src_steps_during"].get("median_ms"))},
        "transfer_gbps_longest_first_stage": transfer,
        "downtime_breakdown_ms": breakdown,
        "goals": goals,
        "runs": {"live": live, "blocking": blocking, "recompute": recompute},
    }


def print_summary(result: dict) -> None:
    print(f"\nlength  live(ms)  stages  last stage(KiB)  blocking(ms)  recompute(ms)  recompute/live   "
          f"[token frames: {result['settings']['limits']['token_frames']}, "
          f"notice steps: {result['settings']['limits'].get('notice_steps')}]")
    for length in result["settings"]["lengths"]:
        live = result["live_downtime_ms_by_length"][length]
        rec = result["recompute_ttft_ms_by_length"][length]
        print(f"{length:>6}  {live:8.2f}  {result['live_stages_by_length'][length]:6.1f}  "
              f"{result['live_last_stage_kib_by_length'][length]:15.1f}  "
              f"{result['blocking_downtime_ms_by_length'][length]:12.2f}  {rec:13.1f}  {rec / live:14.1f}")
    print_stalls(result["live_client_stall_ms_by_length"])
    print_phases(result["live_stall_phases_ms_by_length"])
    b = result["downtime_breakdown_ms"]
    print(f"downtime breakdown (live, all lengths, medians, ms): total {b['downtime_ms']:.2f} = suspend→COMMIT sent "
          f"{b['before_commit_ms']:.2f} (top-up PRE-ALLOC {b['final_prealloc_ms']:.2f}) + COMMIT round trip "
          f"{b['commit_ms']:.2f} (in the last frame; commit paths {result['commit_via']})")
    print(f"  off the downtime: suspend (waits for the source's step in flight) {b['suspend_ms']:.2f}, release after "
          f"the ack {b['release_ms']:.2f} (suspend → release {b['downtime_to_release_ms']:.2f}); client stall "
          f"{b['client_stall_ms']:.2f} at its own ITL {b['own_itl_ms']:.2f}")
    steps = result["src_step_ms"]
    if steps["before_migration"] and steps["during_migration"]:
        print(f"source decode step (median): {steps['before_migration']:.2f} ms without migration, "
              f"{steps['during_migration']:.2f} ms during")
    print(f"transfer (longest, stage 0, median): {result['transfer_gbps_longest_first_stage']:.2f} GB/s")
    print_transfer_vs_raw(result["transfer_over_raw_loopback"])
    for name, value in result["goals"].items():
        print(f"  {name}: {value:.2f}" if value is not None else f"  {name}: -")
