"""Chaos tests' tools: streams that record what a client saw, the output a request must have,
and the three checks every fault ends with (outcomes, free blocks, processes alive)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats

from services.gateway.detokenizer import IncrementalDetokenizer
from services.llumlet.engines import model_vocabulary
from services.llumlet.engines.sim.engine import SyntheticTokens
from shared import subjects
from shared.messages import AbortRequest, GenerateRequest, decode
from shared.nats_client import flush_in_order
from tests.support.cluster import Cluster
from tests.support.observer import NatsObserver

# A simulated llumlet that decodes slowly enough for faults to land mid-decode (10 ms a step).
SIM_ARGS = ("--sim-time-scale", "0.5", "--sim-num-blocks", "400", "--max-model-len", "2048")
HANG_S = 45.0  # a request with no end after this long hung


@dataclass
class Outcome:
    """One streamed completion as its client saw it."""

    request_id: str = ""
    text: str = ""
    events: int = 0
    finish_reason: str | None = None
    error: str | None = None  # a terminal error the client saw (HTTP status or SSE error event)
    status: int = 0
    hung: bool = False
    started: float = field(default_factory=time.monotonic)
    first_at: float = 0.0  # when the first token event arrived (0: none)
    ended: float = 0.0

    @property
    def completed(self) -> bool:
        return self.finish_reason is not None and self.error is None


async def stream_completion(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                            **sampling: object) -> Outcome:
    """A streamed /v1/completions request, recorded as the client saw it; never raises."""
    outcome = Outcome()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, **sampling}
    try:
        async with asyncio.timeout(HANG_S):
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                outcome.status = reply.status_code
                if reply.status_code != 200:
                    outcome.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')}"
                    return outcome
                async for line in _sse_lines(reply):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        outcome.error = event["error"]["message"]
                        continue
                    outcome.request_id = event["id"]
                    outcome.first_at = outcome.first_at or time.monotonic()
                    outcome.events += 1
                    for choice in event["choices"]:
                        outcome.text += choice["text"]
                        outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
    except TimeoutError:
        outcome.hung = True
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended = time.monotonic()
    return outcome


async def _sse_lines(reply: httpx.Response):
    """Lines split on "\n" only: httpx's `aiter_lines` also splits on U+2028, U+0085 and the like,
    which JSON carries unescaped inside the text of a token."""
    buffered = ""
    async for text in reply.aiter_text():
        buffered += text
        *lines, buffered = buffered.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buffered:
        yield buffered


class SimOutput:
    """The text a simulated llumlet's request must stream: its synthetic tokens, detokenized as
    the gateway does (`SyntheticTokens` is a function of the request id and the token index)."""

    def __init__(self, model_dir: Path, seed: int = 0) -> None:
        from services.gateway.tokenizer import ModelTokenizer

        vocab_size, eos, _name = model_vocabulary(str(model_dir))
        self.tokens = SyntheticTokens(vocab_size, eos, seed)
        self.tokenizer = ModelTokenizer.load(str(model_dir))  # the gateway's own decoding
        self._decode = self.tokenizer.decode

    def text(self, request_id: str, prompt: list[int], num_tokens: int) -> str:
        key = self.tokens.key(request_id)
        detok = IncrementalDetokenizer(self._decode, prompt)
        text = "".join(detok.push([self.tokens.token(key, i)]) for i in range(num_tokens))
        return text + detok.flush()


class GenerateLog:
    """Every generate order on the bus: which internal request id a prompt got (the client sees
    another id), and the resumes (orders with `resume_from` > 0)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.orders: list[GenerateRequest] = []

    async def __aenter__(self) -> GenerateLog:
        self.nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

        async def on_order(msg) -> None:
            self.orders.append(decode(msg.data, GenerateRequest))

        await self.nc.subscribe(f"{subjects.PREFIX}.llumlet.*.generate", cb=on_order)
        await flush_in_order(self.nc)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    def request_id(self, prompt: list[int]) -> str:
        """The internal id of the (one) request sent with `prompt`."""
        ids = {o.request_id for o in self.orders if o.resume_from == 0 and o.prompt_token_ids[-len(prompt):] == prompt
               and len(o.prompt_token_ids) <= len(prompt) + 1}  # a BOS token the gateway may add
        assert len(ids) == 1, f"{len(ids)} requests with this prompt"
        return ids.pop()

    @property
    def resumes(self) -> list[GenerateRequest]:
        return [o for o in self.orders if o.resume_from > 0]


class AbortClock:
    """When each request's abort was on the bus, timed by a NATS client on a thread of its own:
    a test's own event loop, busy reading a thousand streams, would read it late and charge its
    own lag to the system under test. Times are `clock()`'s."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.clock = clock
        self.seen: dict[str, float] = {}
        self.beats: list[float] = []  # gateway heartbeats on the bus (llumlets abort a silent gateway's requests)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._watch()), name="abort-clock", daemon=True)

    def __enter__(self) -> AbortClock:
        self._thread.start()
        assert self._ready.wait(10), "the abort clock did not connect"
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    async def _watch(self) -> None:
        nc = await nats.connect(self.url)

        async def on_abort(msg) -> None:
            self.seen.setdefault(decode(msg.data, AbortRequest).request_id, self.clock())

        async def on_beat(msg) -> None:
            self.beats.append(self.clock())

        await nc.subscribe(subjects.ABORT_ALL, cb=on_abort)
        await nc.subscribe(subjects.GATEWAY_HEARTBEATS_ALL, cb=on_beat)
        await flush_in_order(nc)
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await nc.close()


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    failed: int = 0  # ended with a terminal error the client saw
    hung: int = 0
    wrong: int = 0  # completed, but not with the output it must have

    def line(self) -> str:
        return (f"sent {self.sent} completed {self.completed} failed {self.failed} hung {self.hung} "
                f"wrong {self.wrong}")


def judge(outcomes: list[Outcome], expected_texts: list[str] | None = None) -> Tally:
    """Every request completed with the right output (`expected_texts`, in the same order) or
    ended with an error its client saw."""
    tally = Tally()
    for i, outcome in enumerate(outcomes):
        tally.sent += 1
        if outcome.hung:
            tally.hung += 1
        elif outcome.completed:
            tally.completed += 1
            if expected_texts is not None and outcome.text != expected_texts[i]:
                tally.wrong += 1
        else:
            assert outcome.error, f"neither an end nor an error: {outcome}"
            tally.failed += 1
    return tally


async def wait_blocks_back(nats_url: str, instances: Iterable[str], timeout_s: float = 10.0) -> dict[str, str]:
    """Wait until every named (live) instance reports all its KV blocks free and nothing running;
    what is still not back when the time is up (empty: all back)."""
    instances = set(instances)
    async with NatsObserver(nats_url) as observer:

        def back(latest) -> bool:
            return all(i in latest and _idle(latest[i]) for i in instances)

        await observer.wait_for(back, timeout_s)
        return {i: ("no report" if i not in observer.latest else
                    f"{observer.latest[i].num_blocks_free}/{observer.latest[i].num_blocks_total} free, "
                    f"{observer.latest[i].num_running} running, {observer.latest[i].num_waiting} waiting")
                for i in instances if i not in observer.latest or not _idle(observer.latest[i])}


def _idle(report) -> bool:
    return (report.num_blocks_free == report.num_blocks_total and report.num_running == 0
            and report.num_waiting == 0)


def dead_processes(cluster: Cluster, *expected_dead: str) -> list[str]:
    """Processes that should live and do not."""
    return [name for name, proc in cluster.procs.items() if name not in expected_dead and not proc.alive()]


def model_name(cluster: Cluster) -> str:
    return httpx.get(f"{cluster.base_url}/v1/models").json()["data"][0]["id"]


def log_lines(cluster: Cluster, name: str, needle: str) -> list[str]:
    return [line for line in cluster.procs[name].log().splitlines() if needle in line]
