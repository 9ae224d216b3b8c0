"""A gateway whose event loop's stalls are logged, for benchmarks that ask what held it up.

    python -m benchmarks.loop_stalls STALL_LOG [gateway arguments...]

Serves exactly as `python -m services.gateway` does, with one more task on its event loop: a
ticker that sleeps 1 ms and, when it wakes late, appends a line `unix_time wall_ms cpu_ms` to
STALL_LOG. `wall_ms` is how late it woke (the event loop busy, the GIL held by another thread, or
the process waiting for a core); `cpu_ms` is the CPU time the loop's thread spent meanwhile, which
only work on the loop itself accounts for: on a machine shared with other load, a probe's latency
mixes all three, `cpu_ms` tells the event loop's own share.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import TextIO

TICK_S = 0.001
LOGGED_PAST_S = 0.002  # a tick later than this is logged


async def _tick(log: TextIO) -> None:
    while True:
        wall, cpu = time.perf_counter(), time.thread_time()
        await asyncio.sleep(TICK_S)
        late = time.perf_counter() - wall - TICK_S
        if late > LOGGED_PAST_S:
            log.write(f"{time.time():.6f} {1e3 * late:.3f} {1e3 * (time.thread_time() - cpu):.3f}\n")
            log.flush()


async def _serve(config: object, log: TextIO) -> None:
    from services.gateway.server import serve

    ticker = asyncio.create_task(_tick(log))
    try:
        await serve(config)  # type: ignore[arg-type]
    finally:
        ticker.cancel()


def read_stalls(path: Path, start: float, end: float) -> list[tuple[float, float]]:
    """(wall_ms, cpu_ms) of each stall logged between two unix times."""
    stalls = []
    for line in path.read_text().splitlines() if path.exists() else []:
        at, wall, cpu = (float(field) for field in line.split())
        if start <= at <= end:
            stalls.append((wall, cpu))
    return stalls


def main() -> int:
    import uvloop

    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):  # (-h too: not a file to append to)
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2

    from services.gateway.server import config_from_argv

    log_path, gateway_args = sys.argv[1], sys.argv[2:]
    config = config_from_argv(gateway_args, prog="python -m benchmarks.loop_stalls STALL_LOG")
    with open(log_path, "a") as log:
        uvloop.run(_serve(config, log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
