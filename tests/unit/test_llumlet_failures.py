"""A llumlet's refusals and failures over a real nats-server: a request id already running here is
refused (and the running one goes on untouched); an engine step that raises ends every request it
held with an error chunk (never silence) and stops the llumlet's loops, so its process exits."""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest

from services.llumlet.config import LlumletConfig
from services.llumlet.engines.sim.engine import SimEngine
from services.llumlet.service import Llumlet
from shared import subjects
from shared.messages import Ack, FinishReason, Refusal, TokenChunk, decode, encode
from tests.unit.migration_helpers import expected_tokens, gen, sim_config


class Stream:
    """A stand-in gateway's output subject."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.subject = f"test.out.{uuid.uuid4().hex[:8]}"
        self.chunks: list[TokenChunk] = []

    async def start(self) -> Stream:
        async def on_chunk(msg) -> None:
            self.chunks.append(decode(msg.data, TokenChunk))

        await self.nc.subscribe(self.subject, cb=on_chunk)
        return self

    async def submit(self, llumlet: Llumlet, request_id: str, prompt: int, max_tokens: int) -> Ack:
        request = gen(request_id, prompt, max_tokens)
        request.reply_subject = self.subject
        reply = await self.nc.request(subjects.llumlet(llumlet.instance_id, "generate"), encode(request), timeout=2)
        return decode(reply.data, Ack)

    def of(self, request_id: str) -> list[TokenChunk]:
        return [c for c in self.chunks if c.request_id == request_id]

    def tokens(self, request_id: str) -> list[int]:
        return [t for c in sorted(self.of(request_id), key=lambda c: c.start_index) for t in c.token_ids]

    async def wait(self, predicate, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.005)

    def finished(self, request_id: str) -> bool:
        return any(c.finish_reason is not None for c in self.of(request_id))


@pytest.fixture
async def stream(nats_url):
    nc = await nats.connect(nats_url)
    yield await Stream(nc).start()
    await nc.close()


@pytest.fixture
async def llumlet(nats_url):
    config = LlumletConfig(f"fail-{uuid.uuid4().hex[:6]}", nats_url, report_interval_s=0.05)
    llumlet = Llumlet(config, SimEngine(sim_config(time_scale=0.01, num_blocks=256, max_model_len=2048)))
    await llumlet.start()
    yield llumlet
    if llumlet.nc is not None and not llumlet.nc.is_closed:
        await llumlet.stop()


async def test_a_request_id_already_running_here_is_refused_and_the_first_goes_on(llumlet, stream) -> None:
    assert (await stream.submit(llumlet, "dup", prompt=40, max_tokens=600)).ok
    await stream.wait(lambda: len(stream.tokens("dup")) >= 5)
    again = await stream.submit(llumlet, "dup", prompt=10, max_tokens=5)
    assert not again.ok and again.reason is Refusal.DUPLICATE and "already running" in again.error
    await stream.wait(lambda: stream.finished("dup"))
    assert stream.of("dup")[-1].finish_reason is FinishReason.LENGTH
    assert stream.tokens("dup") == expected_tokens(llumlet.engine, "dup", 600)  # one stream, not restarted
    assert (await stream.submit(llumlet, "dup", prompt=10, max_tokens=5)).ok  # finished: the id is free again


async def test_an_engine_failure_ends_every_request_with_an_error_and_stops_the_llumlet(llumlet, stream) -> None:
    for request_id in ("a", "b"):
        assert (await stream.submit(llumlet, request_id, prompt=40, max_tokens=5000)).ok
    await stream.wait(lambda: all(len(stream.tokens(r)) >= 3 for r in ("a", "b")))
    real_step = llumlet.engine.step

    async def broken_step():
        await real_step()
        raise RuntimeError("device lost")

    llumlet.engine.step = broken_step
    with pytest.raises(RuntimeError, match="device lost"):
        await asyncio.wait_for(llumlet.wait_failed(), 5)  # the process exits on this
    await stream.wait(lambda: stream.finished("a") and stream.finished("b"))
    for request_id in ("a", "b"):
        last = stream.of(request_id)[-1]
        assert last.finish_reason is FinishReason.ERROR, last
        assert "engine failure" in last.error and llumlet.instance_id in last.error
        assert len(stream.tokens(request_id)) < 5000
