"""The destination's share of a migration's client-visible stall: one log line per migrated-in
request, from its commit to the end of the step that computed its first token here.

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


def parse_handovers(log_text: str) -> dict[str, dict[str, float]]:
    """By the id each line names (vLLM's internal id carries a suffix after ours): the stamps."""
    return {rid: {"committed_at": float(c), "in_engine_at": float(e), "first_step_started_at": float(s),
                  "first_step_ended_at": float(t)}
            for rid, c, e, s, t in _PATTERN.findall(log_text)}
