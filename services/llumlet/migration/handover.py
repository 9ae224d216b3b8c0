"""The destination's share of a migration's client-visible stall: one log line per migrated-in
request, from its commit to the end of the step that computed its first token here; one for the
price its other requests paid: the gap between the step before its first step and the end of
that first step (their token gap there), with the hold before it (`commit_hold.py`); and one per
commit frame (`kv_connection.py`): when its header was read and when the whole frame was in, so
the last stage's time splits into the wire and the destination's commit.

Times are `time.monotonic()` seconds, absolute: on one host every process reads the same clock,
so a benchmark lines them up with the source's record and with the token arrivals it saw
(`benchmarks/migration_sim.py`, `benchmarks/migration_vllm.py`). Each engine logs the line from
the step that produced the request's first token (`log_first_step`); `parse_handovers` reads them
back.
"""

from __future__ import annotations

import logging
import re

_LINE = "handover %s: committed %.6f, in engine %.6f, first step %.6f-%.6f (monotonic s)"
_PATTERN = re.compile(r"handover (\S+): committed ([\d.]+), in engine ([\d.]+), first step ([\d.]+)-([\d.]+)")


def log_first_step(log: logging.Logger, request_id: str, committed_at: float, in_engine_at: float,
                   step_started_at: float, step_ended_at: float) -> None:
    """The migrated request's first step here ended: committed → in the engine's queue → the
    step that computed its first token (its start and end)."""
    log.info(_LINE, request_id, committed_at, in_engine_at, step_started_at, step_ended_at)


_STEP_LINE = ("handover step %s: step before ended %.6f, this step %.6f-%.6f, held %.3f ms, typical step %.3f ms "
              "(monotonic s)")
_STEP_PATTERN = re.compile(r"handover step (\S+): step before ended ([\d.]+), this step ([\d.]+)-([\d.]+), "
                           r"held ([\d.]+) ms, typical step ([\d.]+) ms")


def log_handover_step(log: logging.Logger, request_id: str, before_ended_at: float | None, step_started_at: float,
                      step_ended_at: float, held_s: float, typical_step_s: float) -> None:
    """The engine loop's first step since the request committed here ended (`runtime.after_step`):
    the other requests in it got no token from the end of the step before until its end."""
    if before_ended_at is not None:
        log.info(_STEP_LINE, request_id, before_ended_at, step_started_at, step_ended_at, 1e3 * held_s,
                 1e3 * typical_step_s)


def parse_handover_steps(log_text: str) -> dict[str, dict[str, float]]:
    """By request id: the step before's end, the first step's start and end, the hold and the
    destination's typical step (ms)."""
    return {rid: {"step_before_ended_at": float(b), "handover_step_started_at": float(s),
                  "handover_step_ended_at": float(e), "held_ms": float(h), "typical_step_ms": float(t)}
            for rid, b, s, e, h, t in _STEP_PATTERN.findall(log_text)}


def parse_handovers(log_text: str) -> dict[str, dict[str, float]]:
    """By the id each line names (vLLM's internal id carries a suffix after ours): the stamps."""
    return {rid: {"committed_at": float(c), "in_engine_at": float(e), "first_step_started_at": float(s),
                  "first_step_ended_at": float(t)}
            for rid, c, e, s, t in _PATTERN.findall(log_text)}


_FRAME_LINE = "commit frame %s: header in %.6f, frame in %.6f (monotonic s)"
_FRAME_PATTERN = re.compile(r"commit frame (\S+): header in ([\d.]+), frame in ([\d.]+)")


def log_commit_frame(log: logging.Logger, migration_id: str, header_at: float, frame_in_at: float) -> None:
    """The last KV frame of a migration (the one carrying its COMMIT) was read: its header at
    `header_at`, all of it (payload, trailer, commit) at `frame_in_at`."""
    log.info(_FRAME_LINE, migration_id, header_at, frame_in_at)


def parse_commit_frames(log_text: str) -> dict[str, dict[str, float]]:
    """By migration id: when its commit frame's header and the whole frame were in."""
    return {mid: {"frame_header_at": float(h), "frame_in_at": float(f)}
            for mid, h, f in _FRAME_PATTERN.findall(log_text)}
