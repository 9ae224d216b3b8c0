"""Large request bodies parsed and validated in worker processes, off the event loop.

Decoding JSON and checking a million token ids holds the GIL for tens of milliseconds: on the event
loop, or on a thread of the same process, that is tens of milliseconds of delay for every other
client (issue 15: one client's request may delay another's by a few milliseconds at most). So a
body of `offload_bytes` or more goes to one of a few worker processes, which runs the same
`parse_body` as the event loop runs on a small body and sends back the typed request or the
typed refusal, both bounded in size (body_parsing: a prompt that cannot fit is not sent back).

The event loop's share of a large body is reading it, writing it to a pipe and decoding the
answer (msgpack into the request's own types): ~1 ms for a 4 MiB body.

Wire, over the worker's stdin/stdout: a job is `>II` (meta length, body length), the meta
(msgpack [route, limits]), then the body's bytes; an answer is `>I` length, then msgpack
[ok, typed body] or [not ok, Refused]; a worker first writes one ready byte. A served gateway starts its workers with it (`start`);
elsewhere (tests) they start on the first large body. One that dies or overruns `timeout_s` is
replaced on the next large body; the request it held gets a 503 (retry), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
import traceback
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from services.gateway.body_parsing import BODY_TYPES, ModelLimits, ParsedBody, Refused, Route, parse_body
from services.gateway.errors import ApiError

log = logging.getLogger(__name__)

_JOB_HEADER = struct.Struct(">II")
_ANSWER_HEADER = struct.Struct(">I")
WORKER_NICENESS = 10
WORKER_TIMEOUT_S = 30.0  # a 4 MiB body parses in ~50 ms: past this the worker is stuck or starved
STARTUP_TIMEOUT_S = 60.0  # from spawn to the worker's ready byte (its imports: ~0.2 s when idle)
_READY = b"R"
_PARSE_FAILED = "the request body could not be parsed: its parser process {}; retry the request"


class _WorkerLost(Exception):
    pass


class _Worker:
    """One worker process and its pipes; one job at a time."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def run(self, meta: bytes, body: bytes) -> bytes:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(_JOB_HEADER.pack(len(meta), len(body)))
            stdin.write(meta)
            stdin.write(body)
            await stdin.drain()
            (length,) = _ANSWER_HEADER.unpack(await stdout.readexactly(_ANSWER_HEADER.size))
            return await stdout.readexactly(length)
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise _WorkerLost(f"exited ({type(exc).__name__})") from None

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def close(self, grace_s: float = 2.0) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # end of input: the worker's loop returns
        try:
            async with asyncio.timeout(grace_s):
                await self.process.wait()
        except TimeoutError:
            self.kill()
            await self.process.wait()


class BodyWorkers:
    """`parse(route, body, limits)`: inline below `offload_bytes` (or with no workers), else in
    one of `workers` processes; at most that many large bodies are parsed at once, the others wait."""

    def __init__(self, workers: int, offload_bytes: int, timeout_s: float = WORKER_TIMEOUT_S) -> None:
        assert workers >= 0 and offload_bytes > 0
        self.offload_bytes = offload_bytes
        self.timeout_s = timeout_s
        self._size = workers
        self._slots = asyncio.Semaphore(workers) if workers else None
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._jobs: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._answers = {route: msgspec.msgpack.Decoder(body_type) for route, body_type in BODY_TYPES.items()}
        self._refusals = msgspec.msgpack.Decoder(Refused)
        self._envelopes = msgspec.msgpack.Decoder(tuple[bool, msgspec.Raw])
        self.offloaded = 0  # bodies parsed by a worker (tests, benchmarks)

    async def start(self) -> None:
        """Start every worker now, so that the first large body does not wait for one (~0.2 s).
        One that cannot start (logged) is tried again for the first large body."""
        while len(self._idle) + len(self._busy) < self._size:
            try:
                self._idle.append(await self._spawn())
            except ApiError:
                return

    async def parse(self, route: Route, body: bytes, limits: ModelLimits) -> ParsedBody:
        """The typed body; raises ApiError for a body refused at once (as parse_body does)."""
        if self._slots is None or len(body) < self.offload_bytes:
            return parse_body(route, body, limits)
        job = asyncio.ensure_future(self._offload(route, body, limits))
        self._jobs.add(job)
        job.add_done_callback(self._forget)
        # A client that leaves mid-parse cancels its handler, not the job: the worker's answer
        # must still be read off its pipe before the worker takes the next body.
        return await asyncio.shield(job)

    def _forget(self, job: asyncio.Task[Any]) -> None:
        self._jobs.discard(job)
        if not job.cancelled():
            job.exception()  # retrieved: a refusal for a client that has left is no error to log

    async def _offload(self, route: Route, body: bytes, limits: ModelLimits) -> ParsedBody:
        assert self._slots is not None
        async with self._slots:
            if self._closed:
                raise ApiError(503, "the gateway is shutting down")
            worker = self._idle.pop() if self._idle else await self._spawn()
            self._busy.add(worker)
            try:
                async with asyncio.timeout(self.timeout_s):
                    answer = await worker.run(msgspec.msgpack.encode((route, limits)), body)
            except (_WorkerLost, TimeoutError) as exc:
                worker.kill()
                what = str(exc) if isinstance(exc, _WorkerLost) else f"took over {self.timeout_s:g} s"
                log.error("body parser worker %d %s; it will be replaced", worker.process.pid, what)
                raise ApiError(503, _PARSE_FAILED.format(what), headers={"retry-after": "1"}) from None
            else:
                self._idle.append(worker)
            finally:
                self._busy.discard(worker)
        self.offloaded += 1
        ok, payload = self._envelopes.decode(answer)
        if not ok:
            raise self._refusals.decode(payload).error()
        return self._answers[route].decode(payload)  # type: ignore[no-any-return]

    async def _spawn(self) -> _Worker:
        # The package's root on the path: the worker imports it whatever the gateway's cwd is.
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.gateway.body_workers", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env)
        except OSError as exc:
            log.error("cannot start a body parser worker: %s", exc)
            raise ApiError(503, _PARSE_FAILED.format(f"could not start ({exc})"),
                           headers={"retry-after": "1"}) from None
        worker = _Worker(process)
        try:  # ready: a job's timeout then counts its parsing only, never the worker's start
            assert process.stdout is not None
            async with asyncio.timeout(STARTUP_TIMEOUT_S):
                ready = await process.stdout.readexactly(len(_READY))
            assert ready == _READY, ready
        except (OSError, AssertionError, asyncio.IncompleteReadError, TimeoutError) as exc:
            worker.kill()
            log.error("a body parser worker did not start: %r", exc)
            raise ApiError(503, _PARSE_FAILED.format("did not start"), headers={"retry-after": "1"}) from None
        return worker

    async def close(self) -> None:
        self._closed = True
        for worker in self._busy:
            worker.kill()
        await asyncio.gather(*self._jobs, return_exceptions=True)
        idle, self._idle = self._idle, []
        await asyncio.gather(*(w.close() for w in idle), return_exceptions=True)


# ---- the worker process ------------------------------------------------------------------------


def serve(source: BinaryIO, sink: BinaryIO) -> None:
    """Answer jobs until the input ends."""
    jobs = msgspec.msgpack.Decoder(tuple[Route, ModelLimits])
    encoder = msgspec.msgpack.Encoder()
    sink.write(_READY)
    sink.flush()
    while True:
        header = source.read(_JOB_HEADER.size)
        if len(header) < _JOB_HEADER.size:
            return  # the gateway closed the pipe (or died)
        meta_length, body_length = _JOB_HEADER.unpack(header)
        route, limits = jobs.decode(source.read(meta_length))
        body = source.read(body_length)
        answer = _answer(route, body, limits, encoder)
        del body
        sink.write(_ANSWER_HEADER.pack(len(answer)))
        sink.write(answer)
        sink.flush()


def _answer(route: Route, body: bytes, limits: ModelLimits, encoder: msgspec.msgpack.Encoder) -> bytes:
    try:
        try:
            return encoder.encode((True, parse_body(route, body, limits)))
        except ApiError as error:
            return encoder.encode((False, Refused.of(error)))
    except Exception as exc:  # a bug: the 500 that UnexpectedErrorMiddleware answers inline
        traceback.print_exc(file=sys.stderr)
        return encoder.encode((False, Refused(500, f"internal error: {type(exc).__name__}: {exc}")))


if __name__ == "__main__":
    # Below the gateway's priority: where cores are few, its event loop (every other client's
    # requests) goes first, and a large body waits for a core instead.
    os.nice(WORKER_NICENESS)
    serve(sys.stdin.buffer, sys.stdout.buffer)
