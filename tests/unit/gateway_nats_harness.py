"""The gateway's NATS side under test: a real nats-server, fake llumlets and a fake scheduler that
answer like the real ones, and the cluster fixture that wires a gateway to them. Used by
test_gateway_nats*.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable

import httpx
import nats
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.gateway.tokenizer import ModelTokenizer
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import (
    AbortRequest,
    Ack,
    DispatchReply,
    DispatchRequest,
    FinishReason,
    GenerateRequest,
    LoadReport,
    Refusal,
    TokenChunk,
    decode,
    encode,
)
from shared.nats_client import flush_in_order
from tests.support.polling import wait_until


CHAT = "/v1/chat/completions"


HELLO = [{"role": "user", "content": "hello"}]


OUTPUT = [40 + i for i in range(8)]  # the tokens every fake instance generates


INSTANCE_TIMEOUT_S = 0.6


_ids = itertools.count()


@pytest.fixture(scope="module")
def nats_url():
    server = start_nats()  # our own: scripted schedulers must not meet real ones from other tests
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> ModelTokenizer:
    from services.tools.make_model import build_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tiny-tok"
    build_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    return ModelTokenizer.load(str(path))


class FakeLlumlet:
    """Acks generate orders, streams OUTPUT (or what `emit` says), reports load, records aborts."""

    def __init__(self, nc, instance_id: str, *, max_model_len: int = 128) -> None:
        self.nc = nc
        self.instance_id = instance_id
        self.max_model_len = max_model_len
        self.requests: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.ack_error: str | None = None
        self.ack_reason: Refusal | None = None
        self.emit: Callable[[GenerateRequest], list[TokenChunk | float]] = self.emit_all
        self.reporting = True
        self._subs = []
        self._tasks: list[asyncio.Task] = []

    def emit_all(self, request: GenerateRequest) -> list[TokenChunk | float]:
        tokens = OUTPUT[:request.sampling.max_tokens]
        finish = FinishReason.LENGTH if len(tokens) == request.sampling.max_tokens else FinishReason.STOP
        return [self.chunk(request, i, [t], finish if i == len(tokens) - 1 else None) for i, t in enumerate(tokens)]

    def chunk(self, request: GenerateRequest, start: int, tokens: list[int], finish=None) -> TokenChunk:
        return TokenChunk(request.request_id, self.instance_id, start, tokens, finish_reason=finish)

    async def start(self) -> FakeLlumlet:
        self._subs = [
            await self.nc.subscribe(subjects.llumlet(self.instance_id, "generate"), cb=self._on_generate),
            await self.nc.subscribe(subjects.ABORT_ALL, cb=self._on_abort),
        ]
        self._tasks.append(asyncio.create_task(self._report_loop()))
        await flush_in_order(self.nc)
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_generate(self, msg) -> None:
        request = decode(msg.data, GenerateRequest)
        self.requests.append(request)
        await msg.respond(encode(Ack(ok=self.ack_error is None, error=self.ack_error, reason=self.ack_reason)))
        if self.ack_error is None:
            self._tasks.append(asyncio.create_task(self._stream(request, self.emit(request))))

    async def _stream(self, request: GenerateRequest, script: list[TokenChunk | float]) -> None:
        for step in script:
            if isinstance(step, float):
                await asyncio.sleep(step)
            else:
                await self.nc.publish(request.reply_subject, encode(step))
                await asyncio.sleep(0.005)

    async def _on_abort(self, msg) -> None:
        self.aborts.append(decode(msg.data, AbortRequest).request_id)

    async def _report_loop(self) -> None:
        for seq in itertools.count(1):
            if self.reporting:
                report = LoadReport(self.instance_id, seq, time.time(), num_blocks_total=1000, num_blocks_free=1000,
                                    block_size=16, num_running=0, num_waiting=0, head_demand_blocks=0,
                                    waiting_demand_blocks=0, num_preemptions_total=0, max_model_len=self.max_model_len)
                await self.nc.publish(subjects.load_report(self.instance_id), encode(report))
            await asyncio.sleep(0.05)


class FakeScheduler:
    def __init__(self, nc, decide: Callable[[DispatchRequest], DispatchReply]) -> None:
        self.nc = nc
        self.decide = decide
        self.requests: list[DispatchRequest] = []

    async def start(self) -> FakeScheduler:
        async def on_dispatch(msg) -> None:
            request = decode(msg.data, DispatchRequest)
            self.requests.append(request)
            await msg.respond(encode(self.decide(request)))

        self.sub = await self.nc.subscribe(subjects.DISPATCH, queue=subjects.SCHEDULER_QUEUE, cb=on_dispatch)
        await flush_in_order(self.nc)
        return self


class Cluster:
    """One gateway plus whatever fakes a test adds; everything stopped at the end."""

    def __init__(self, nc, gateway: GatewayService) -> None:
        self.nc = nc
        self.gateway = gateway
        self.llumlets: list[FakeLlumlet] = []
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw")

    async def llumlet(self, name: str, **kwargs) -> FakeLlumlet:
        llumlet = await FakeLlumlet(self.nc, f"{name}-{next(_ids)}", **kwargs).start()
        self.llumlets.append(llumlet)
        return llumlet

    async def scheduler(self, decide: Callable[[DispatchRequest], DispatchReply]) -> FakeScheduler:
        self._scheduler = await FakeScheduler(self.nc, decide).start()
        return self._scheduler

    async def until_alive(self, count: int) -> None:
        for _ in range(100):
            if self.gateway.instances.alive_count() >= count:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the gateway never heard the load reports")

    async def close(self) -> None:
        await self.client.aclose()
        for llumlet in self.llumlets:
            await llumlet.stop()
        if hasattr(self, "_scheduler"):
            await self._scheduler.sub.unsubscribe()
        await self.gateway.stop()


@pytest.fixture
async def cluster(nats_url, tokenizer):
    nc = await nats.connect(nats_url)
    config = GatewayConfig(model_dir="/models/tiny-tok", nats_url=nats_url, gateway_id=f"gw-{next(_ids)}",
                           dispatch_timeout_s=0.2, generate_timeout_s=0.5, instance_timeout_s=INSTANCE_TIMEOUT_S,
                           request_inactivity_timeout_s=5.0)
    gateway = GatewayService(config, tokenizer)
    await gateway.start()
    cluster = Cluster(nc, gateway)
    yield cluster
    await cluster.close()
    await nc.drain()


def text_of(tokenizer: ModelTokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    await wait_until(predicate, timeout_s, interval_s=0.02)
