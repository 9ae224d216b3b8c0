"""The cancellation load, shared by tests/chaos/test_cancellation.py and
benchmarks/cancellation.py: concurrent streams, half closed by their client after a random
number of events, with when each was cut, when its connection closed and when its abort was on
the bus (`AbortClock`, a NATS client on a thread of its own)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable

import httpx

from tests.chaos.harness import AbortClock


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sse_frames(reply: httpx.Response):
    """The `data: {…}` frames of an SSE body, unparsed, split on blank lines only (a token's text
    may hold a character that `aiter_lines` takes for a line break). Parsing every frame of
    1,000 streams was most of this client's CPU: on 2 cores it delayed its own closes, timed as
    the gateway's."""
    buffer = b""
    async for data in reply.aiter_bytes():
        buffer += data
        *frames, buffer = buffer.split(b"\n\n")
        for frame in frames:
            if frame.startswith(b"data: {"):
                yield frame


async def cut_half(base_url: str, nats_url: str, streams: int, tokens: int, seed: int = 0,
                   clock: Callable[[], float] = time.monotonic) -> dict:
    """`streams` concurrent streams of `tokens` tokens; every other one is closed by its client
    after a random number of events. Times are `clock()`'s. Outcomes count completed, cut and
    failed streams, and any HTTP error by its name (a read timeout: a stream silent for 120 s)."""
    rng = random.Random(seed)
    cut_at: dict[str, float] = {}
    closed_at: dict[str, float] = {}  # when the client's connection was closed (its own lag after the cut)
    outcomes = {"completed": 0, "cut": 0, "failed": 0}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        name = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> None:
            cut_after = rng.randint(1, tokens // 4) if i % 2 else None  # (an event may carry several tokens)
            body = {"model": name, "prompt": [1 + rng.randrange(200) for _ in range(8 + i % 9)], "max_tokens": tokens,
                    "stream": True, "ignore_eos": True}
            events, cut_id = 0, None
            try:
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    if reply.status_code != 200:
                        outcomes["failed"] += 1
                        return
                    async for frame in sse_frames(reply):
                        if frame.startswith(b'data: {"error"'):
                            outcomes["failed"] += 1
                            return
                        events += 1
                        if events == cut_after:
                            cut_id = json.loads(frame[6:])["id"]
                            cut_at[cut_id] = clock()
                            outcomes["cut"] += 1
                            break  # leaving the block closes the connection: the gateway aborts
                if cut_id is not None:
                    closed_at[cut_id] = clock()
                    return
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                return
            outcomes["completed"] += 1

        with AbortClock(nats_url, clock=clock) as abort_clock:
            started = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(streams)))
            took = time.monotonic() - started
            await asyncio.sleep(2.0)  # the last aborts land
    gaps = [b - a for a, b in zip(abort_clock.beats, abort_clock.beats[1:])]
    return {"outcomes": outcomes, "took_s": took, "cut_at": cut_at, "closed_at": closed_at,
            "on_bus": abort_clock.seen, "heartbeat_gap_max_s": max(gaps, default=None)}
