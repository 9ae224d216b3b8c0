"""The stall as the client sees it: a recorder process of its own stamps each token chunk's arrival,
the gateway's ordering (`services.gateway.streams`) finds the gap between the last new token from
the source and the first from the destination, and the destination's handover log line splits it
into phases (suspend, last stage, commit, into the engine, the step in flight, the first step, to
the client). Shared by migration_sim.py and migration_vllm.py."""

from __future__ import annotations

import asyncio
import statistics
import struct
import subprocess
import sys
from collections import defaultdict

from services.gateway.streams import HandoverClock, TokenOrderer
from services.llumlet.migration.handover import parse_commit_frames, parse_handover_steps, parse_handovers
from services.process_helpers import die_with_parent
from shared.messages import TokenChunk, decode


class Chunks:
    """Arrival time and publisher of every token chunk, per request; and each request's stream as
    the gateway orders it: when new tokens reached the client, and each migration's stall."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[tuple[float, TokenChunk]]] = defaultdict(list)
        self._orderers: dict[str, TokenOrderer] = defaultdict(TokenOrderer)
        self._clocks: dict[str, HandoverClock] = defaultdict(HandoverClock)
        self.deliveries: dict[str, list[float]] = defaultdict(list)  # when new tokens reached the client
        self.gaps: dict[str, list[float]] = defaultdict(list)  # between them, but at a migration
        self.stalls: dict[str, list[float]] = defaultdict(list)  # at each migration (seconds)
        # At each migration: when the last new token from the source and the first from the
        # destination reached the client (monotonic seconds).
        self.handovers: dict[str, list[tuple[float, float]]] = defaultdict(list)

    async def on_chunk(self, msg) -> None:
        """A chunk relayed by the client recorder (`record_client`), with its arrival time there."""
        (now,) = _STAMP.unpack_from(msg.data)
        chunk = decode(msg.data[_STAMP.size:], TokenChunk)
        rid = chunk.request_id
        self.by_request[rid].append((now, chunk))
        clock = self._clocks[rid]
        if chunk.handover:  # (as `OutputStream.feed`: only a handover starts a stall)
            clock.handed_over()
        if any(d.token_ids for d in self._orderers[rid].accept(chunk)):
            stall = clock.delivered(now)
            if stall is not None:
                self.stalls[rid].append(stall)
                self.handovers[rid].append((now - stall, now))
            elif self.deliveries[rid]:
                self.gaps[rid].append(now - self.deliveries[rid][-1])
            self.deliveries[rid].append(now)

    def client_view(self, request_id: str) -> dict:
        """The first migration's stall, and the request's median gap between new tokens apart
        from its stalls (ms); when its tokens reached the client on either side (monotonic s)."""
        src_token_at, dst_token_at = self.handovers[request_id][0]
        return {"client_stall_ms": 1e3 * self.stalls[request_id][0],
                "own_itl_ms": 1e3 * statistics.median(self.gaps[request_id]),
                "src_token_at_client": src_token_at, "dst_token_at_client": dst_token_at}

    def largest_gap_around(self, request_ids: list[str], start: float, end: float) -> dict | None:
        """The largest gap between new tokens of `request_ids` (a destination's other requests)
        that overlaps [start, end] (a handover), and their median gap over the 64 before (ms)."""
        largest, usual = 0.0, []
        for rid in request_ids:
            times = self.deliveries.get(rid, [])
            gaps = [(a, b) for a, b in zip(times, times[1:])]
            largest = max([largest, *(b - a for a, b in gaps if b >= start and a <= end)])
            usual += [b - a for a, b in gaps if b < start][-64:]
        if not usual:
            return None
        return {"largest_gap_ms": 1e3 * largest, "usual_gap_ms": 1e3 * statistics.median(usual)}

    def count_from(self, request_id: str, instance_id: str) -> int:
        return sum(len(c.token_ids) for _, c in self.by_request[request_id] if c.instance_id == instance_id)

    def token_times(self, request_id: str, instance_id: str) -> list[float]:
        return [t for t, c in self.by_request[request_id] if c.instance_id == instance_id and c.token_ids]


_STAMP = struct.Struct("!d")  # the client recorder's arrival time (monotonic s) before each relayed chunk


_RELAY = ".recorded"  # suffix of the subject the recorder relays a subject's chunks on


_RECORDER = """
import asyncio, sys, time, struct, nats, uvloop
async def main(url, subject):
    nc = await nats.connect(url)
    stamp = struct.Struct("!d")
    async def on(msg):
        await nc.publish(subject + "{relay}", stamp.pack(time.monotonic()) + msg.data)
    await nc.subscribe(subject, cb=on)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main(sys.argv[1], sys.argv[2]))
""".format(relay=_RELAY)


async def record_client(nc, nats_url: str, subject: str, chunks: Chunks) -> subprocess.Popen:
    """The client, in a process of its own (as the gateway is): it stamps when each chunk on
    `subject` arrived and relays it to `chunks`. Stamped here, arrivals would wait for this
    process's event loop and GIL, which the source llumlet (and its engine thread) share."""
    await nc.subscribe(subject + _RELAY, cb=chunks.on_chunk)
    proc = subprocess.Popen([sys.executable, "-c", _RECORDER, nats_url, subject], stdout=subprocess.PIPE,
                            preexec_fn=die_with_parent)
    line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
    if line.strip() != b"ready":
        proc.kill()
        raise RuntimeError("the client recorder did not start")
    return proc


# The stall, phase by phase: each from the previous point to its own (ms). Their sum less
# `src_token_to_client` is the stall itself.
HANDOVER_PHASES = (
    ("src_step_end_to_suspended", "src_last_step_end_at", "suspended_at"),
    ("suspended_to_last_stage_sent", "suspended_at", "commit_sent_at"),
    # The last stage, split by the destination's commit-frame line: the source's send and the
    # wire until the header is read, the rest of the frame, the destination's commit.
    ("last_stage_to_frame_header", "commit_sent_at", "frame_header_at"),
    ("frame_header_to_frame_in", "frame_header_at", "frame_in_at"),
    ("frame_in_to_dst_commit", "frame_in_at", "committed_at"),
    ("dst_commit_to_in_engine", "committed_at", "in_engine_at"),
    ("in_engine_to_its_step", "in_engine_at", "first_step_started_at"),
    ("dst_first_step", "first_step_started_at", "first_step_ended_at"),
    ("dst_step_end_to_client", "first_step_ended_at", "dst_token_at_client"),
)


def source_stamps(m, steps: list[tuple], client: dict) -> dict:
    """The source's side of one handover (monotonic s): the end of its last step before the
    suspend (the step of its last token), the suspend, the last stage out, the commit's ack."""
    ends = [step[0] + step[1] for step in steps if step[0] + step[1] <= m.suspended_at]
    return {"migration_id": m.migration_id,
            "src_last_step_end_at": max(ends) if ends else None, "suspended_at": m.suspended_at,
            "commit_sent_at": m.commit_sent_at, "acked_at": m.committed_at,
            "noticed_at": m.noticed_at, "notice_commit_in_s": m.notice_commit_in_s,
            "src_token_at_client": client["src_token_at_client"], "dst_token_at_client": client["dst_token_at_client"]}


def handover_phases(stamps: dict, destination: dict) -> dict | None:
    """One migration's stall by phase (ms), from its source stamps and its destination's log
    line (`parse_handovers`); None when either side is missing."""
    points = {**stamps, **destination}
    if any(points.get(key) is None for _, a, b in HANDOVER_PHASES for key in (a, b)):
        return None
    phases = {name: 1e3 * (points[b] - points[a]) for name, a, b in HANDOVER_PHASES}
    phases["src_token_to_client"] = 1e3 * (points["src_token_at_client"] - points["src_last_step_end_at"])
    phases["ack_after_dst_commit"] = 1e3 * (points["acked_at"] - points["committed_at"])
    return phases


def attach_phases(rows: list[dict], log_text: str) -> None:
    """Each row's `phases` from the destination's handover lines (matched by request id; vLLM's
    internal id carries a suffix), and `others`: the price the destination's other requests paid,
    their token gap at the engine around the request's first step there (the end of the step
    before → the end of that step, a hold for its commit included) against its typical step."""
    lines, steps, frames = parse_handovers(log_text), parse_handover_steps(log_text), parse_commit_frames(log_text)
    for row in rows:
        rid = row["request_id"]
        destination = lines.get(rid) or next((v for k, v in lines.items() if k.startswith(rid + "-")), None)
        if destination is not None:  # (no frame line: the commit went over NATS; no breakdown then)
            destination = {**destination, **frames.get(row["handover"].get("migration_id"), {})}
        row["phases"] = handover_phases(row["handover"], destination) if destination else None
        step = steps.get(rid)
        row["others"] = None if step is None else {
            "gap_ms": 1e3 * (step["handover_step_ended_at"] - step["step_before_ended_at"]),
            "held_ms": step["held_ms"], "typical_step_ms": step["typical_step_ms"]}


def phases_by_length(rows: list[dict]) -> dict[int, dict[str, dict]]:
    """Per length and phase: median and P90 (ms) over the rows that have a breakdown."""
    out: dict[int, dict[str, dict]] = {}
    for length in sorted({r["length"] for r in rows}):
        have = [r["phases"] for r in rows if r["length"] == length and r.get("phases")]
        if have:
            out[length] = {name: {"median": statistics.median(p[name] for p in have),
                                  "p90": percentile([p[name] for p in have], 90)} for name in have[0]}
    return out


def print_phases(by_length: dict[int, dict[str, dict]]) -> None:
    if not by_length:
        print("\nno handover breakdown (no destination handover lines)")
        return
    names = list(next(iter(by_length.values())))
    print("\nwhere the stall goes, median (P90) ms per length; stall = sum of the phases less src_token_to_client")
    print(f"{'phase':>30}" + "".join(f"{length:>16}" for length in by_length))
    for name in names:
        cells = "".join(f"{by_length[length][name]['median']:8.2f} ({by_length[length][name]['p90']:5.1f})"
                        for length in by_length)
        print(f"{name:>30}{cells}")


def stall_by_length(rows: list[dict]) -> dict[int, dict]:
    """Per length: the client stall's median and P90, the requests' own median ITL, and the
    stall less that ITL (what the migration added: 0 is a perfect handover), in ms."""
    lengths = sorted({r["length"] for r in rows})
    out = {}
    for length in lengths:
        stalls = [r["client_stall_ms"] for r in rows if r["length"] == length]
        itls = [r["own_itl_ms"] for r in rows if r["length"] == length]
        extra = [r["client_stall_ms"] - r["own_itl_ms"] for r in rows if r["length"] == length]
        out[length] = {"median": statistics.median(stalls), "p90": percentile(stalls, 90),
                       "own_itl_median": statistics.median(itls), "extra_median": statistics.median(extra),
                       "extra_p90": percentile(extra, 90), "runs": len(stalls),
                       # issue 20's target: one own step + 2 ms at the median, two at P90
                       "target_met": statistics.median(stalls) <= statistics.median(itls) + 2.0
                       and percentile(stalls, 90) <= 2 * statistics.median(itls)}
        seen = [r["others_client"] for r in rows if r["length"] == length and r.get("others_client")]
        if seen:  # the same at the client (where the benchmark records the others' tokens)
            out[length].update(others_client_gap_median=statistics.median(o["largest_gap_ms"] for o in seen),
                               others_client_gap_max=max(o["largest_gap_ms"] for o in seen),
                               others_client_usual_gap=statistics.median(o["usual_gap_ms"] for o in seen))
        others = [r["others"] for r in rows if r["length"] == length and r.get("others")]
        if others:  # the price: the destination's other requests' gap around the handover step
            gaps = [o["gap_ms"] for o in others]
            out[length].update(others_gap_median=statistics.median(gaps), others_gap_p90=percentile(gaps, 90),
                               others_gap_max=max(gaps),
                               others_typical_step=statistics.median(o["typical_step_ms"] for o in others),
                               held_median=statistics.median(o["held_ms"] for o in others),
                               held_max=max(o["held_ms"] for o in others))
    return out


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between order statistics (numpy's default); the value itself for one."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def print_stalls(stalls: dict[int, dict]) -> None:
    print("\nclient stall at the handover (ms): length  median  p90  its own ITL  stall-ITL median/p90  runs  target"
          "  | destination's others: gap median/p90/max, typical step, held median/max")
    for length, v in stalls.items():
        others = "-"
        if "others_gap_median" in v:
            others = (f"{v['others_gap_median']:6.1f} / {v['others_gap_p90']:5.1f} / {v['others_gap_max']:5.1f}, "
                      f"{v['others_typical_step']:5.1f}, {v['held_median']:5.1f} / {v['held_max']:5.1f}")
        print(f"{length:>40}  {v['median']:6.1f}  {v['p90']:5.1f}  {v['own_itl_median']:11.1f}  "
              f"{v['extra_median']:9.1f} / {v['extra_p90']:.1f}  {v['runs']:4d}  {'met' if v['target_met'] else 'MISSED':>6}"
              f"  | {others}")
    if any("others_client_gap_median" in v for v in stalls.values()):
        print("destination's others at the client (ms): length  largest gap median/max  their usual gap")
        for length, v in stalls.items():
            if "others_client_gap_median" in v:
                print(f"{length:>40}  {v['others_client_gap_median']:6.1f} / {v['others_client_gap_max']:6.1f}  "
                      f"{v['others_client_usual_gap']:6.1f}")
