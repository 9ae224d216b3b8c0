"""The gateway against a real nats-server, with scripted llumlets and schedulers in the test.

Covers the wire protocol with the rest of Corral: dispatch through the scheduler or in bypass
mode, generate/Ack, token chunks from several instances, dead instances, and aborts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import time
from collections.abc import Callable

import httpx
import nats
import pytest
import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.gateway.tokenizer import ModelTokenizer
from shared import subjects
from shared.embedded_nats import start_nats
from shared.messages import (
    AbortRequest, Ack, DispatchReply, DispatchRequest, FinishReason, GenerateRequest, LoadReport, Refusal, TokenChunk,
    decode,
    encode,
)

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
        await self.nc.flush()
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
        await self.nc.flush()
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
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_bypass_mode_dispatches_from_load_reports(cluster, tokenizer, caplog):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    with caplog.at_level(logging.WARNING, logger="services.gateway.dispatcher"):
        bodies = [(await cluster.client.post(CHAT, json={"messages": HELLO})).json() for _ in range(2)]
    assert [b["choices"][0]["message"]["content"] for b in bodies] == [text_of(tokenizer, OUTPUT)] * 2
    assert len(llumlet.requests) == 2
    assert sum("bypass mode" in r.message for r in caplog.records) == 1  # once per episode
    assert "corral:gateway_bypass_dispatches_total 2.0" in cluster.gateway.metrics.render().decode()


async def test_generate_request_carries_everything_the_llumlet_needs(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    await cluster.client.post(CHAT, json={"messages": HELLO, "max_tokens": 3, "temperature": 0, "seed": 7,
                                          "priority": "high"})
    [request] = llumlet.requests
    assert request.reply_subject == cluster.gateway.output_subject
    assert request.priority == -1 and abs(request.arrival_time - time.time()) < 5
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.seed) == (3, 0.0, 7)
    assert request.prompt_token_ids == cluster.gateway.tokenizer.apply_chat_template(HELLO)


async def test_scheduler_decision_is_followed(cluster, tokenizer):
    a, b = await cluster.llumlet("a"), await cluster.llumlet("b")
    scheduler = await cluster.scheduler(lambda request: DispatchReply(instance_id=b.instance_id))
    await cluster.until_alive(2)
    body = (await cluster.client.post(CHAT, json={"messages": HELLO, "max_tokens": 4, "priority": 2})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT[:4])
    assert (len(a.requests), len(b.requests)) == (0, 1)
    [dispatch] = scheduler.requests
    assert (dispatch.num_prompt_tokens, dispatch.max_tokens, dispatch.priority) == (len(b.requests[0].prompt_token_ids), 4, 2)
    assert "corral:gateway_bypass_dispatches_total 0.0" in cluster.gateway.metrics.render().decode()


async def test_scheduler_rejection_is_a_429_with_retry_after(cluster):
    await cluster.scheduler(lambda request: DispatchReply(rejected="all instances are overloaded", retry_after_s=2.5))
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    error = response.json()["error"]
    assert error["type"] == "RateLimitError" and "overloaded" in error["message"]


@pytest.mark.parametrize("path, body, param", [(CHAT, {"messages": HELLO}, "messages"),
                                                 ("/v1/completions", {"prompt": "hello"}, "prompt")])
async def test_prompt_too_long_for_every_instance_is_a_400_naming_the_prompt(cluster, path, body, param):
    await cluster.scheduler(lambda request: DispatchReply(rejected="prompt is longer than any instance's max_model_len",
                                                          reason=Refusal.TOO_LONG))
    response = await cluster.client.post(path, json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and "max_model_len" in error["message"] and error["param"] == param


async def test_no_live_instance_is_a_503(cluster):
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"


async def test_vanished_instance_is_excluded_and_dispatch_retried(cluster, tokenizer):
    live = await cluster.llumlet("a")
    scheduler = await cluster.scheduler(
        lambda request: DispatchReply(instance_id="ghost-1" if not request.exclude else live.instance_id))
    body = (await cluster.client.post(CHAT, json={"messages": HELLO})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT)
    assert [r.exclude for r in scheduler.requests] == [[], ["ghost-1"]]
    assert cluster.gateway.instances.is_silent("ghost-1", since=time.monotonic())


@pytest.mark.parametrize("reason, status", [(Refusal.TOO_LONG, 400), (Refusal.INVALID, 400), (Refusal.DUPLICATE, 409)])
async def test_llumlet_refusals_map_to_http_errors_by_reason_not_words(cluster, reason, status):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.ack_error, llumlet.ack_reason = "words that say nothing about the cause", reason
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == status and "words that say nothing" in response.json()["error"]["message"]
    assert len(llumlet.requests) == 1  # the client's fault: not tried elsewhere
    label = f'corral:gateway_rejections_total{{endpoint="{CHAT}",model_name="tiny-tok",reason="{reason.value}"}} 1.0'
    assert label in cluster.gateway.metrics.render().decode()


async def test_a_leaving_instance_refusal_is_tried_on_another(cluster, tokenizer):
    leaving, staying = await cluster.llumlet("leaving"), await cluster.llumlet("staying")
    await cluster.until_alive(2)
    leaving.ack_error, leaving.ack_reason = "instance is shutting down", Refusal.DRAINING
    await cluster.scheduler(
        lambda request: DispatchReply(instance_id=staying.instance_id if request.exclude else leaving.instance_id))
    body = (await cluster.client.post(CHAT, json={"messages": HELLO})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT)
    assert len(leaving.requests) == 1 and len(staying.requests) == 1


async def test_every_instance_leaving_is_a_503(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.ack_error, llumlet.ack_reason = "instance is shutting down", Refusal.DRAINING
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"
    assert len(llumlet.requests) == 1  # excluded from the second try, which finds no other instance


async def test_max_tokens_fits_the_instance_context(cluster):
    llumlet = await cluster.llumlet("a", max_model_len=40)
    await cluster.until_alive(1)
    await cluster.client.post(CHAT, json={"messages": HELLO})
    [request] = llumlet.requests
    assert len(request.prompt_token_ids) + request.sampling.max_tokens == 40


async def test_migrated_request_streams_each_token_once(cluster, tokenizer):
    source, destination = await cluster.llumlet("src"), await cluster.llumlet("dst")
    await cluster.scheduler(lambda request: DispatchReply(instance_id=source.instance_id))
    await cluster.until_alive(2)

    def migrate(request: GenerateRequest) -> list[TokenChunk | float]:
        request_id = request.request_id
        asyncio.get_running_loop().call_later(0.03, lambda: destination._tasks.append(asyncio.create_task(
            destination._stream(request, [destination.chunk(request, 3, OUTPUT[3:6]),
                                          destination.chunk(request, 6, OUTPUT[6:], FinishReason.STOP)]))))
        assert request_id
        return [source.chunk(request, 0, OUTPUT[:2]), 0.06, source.chunk(request, 2, OUTPUT[2:4])]  # late, overlapping

    source.emit = migrate
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    events = [json.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == text_of(tokenizer, OUTPUT)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_request_fails_when_its_instance_goes_silent(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)

    def die(request: GenerateRequest) -> list[TokenChunk | float]:
        llumlet.reporting = False
        return [llumlet.chunk(request, 0, OUTPUT[:2])]

    llumlet.emit = die
    started = time.monotonic()
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "stream": True})
    assert time.monotonic() - started < INSTANCE_TIMEOUT_S + 2.0
    events = response.text.split("\n\n")
    error = json.loads(events[-3][len("data: "):])["error"]
    assert error["code"] == 503 and llumlet.instance_id in error["message"] and events[-2] == "data: [DONE]"
    await eventually(lambda: bool(llumlet.aborts))
    assert llumlet.aborts == [llumlet.requests[0].request_id]


async def test_bad_payloads_are_dropped_without_harm(cluster, tokenizer):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    await cluster.nc.publish(cluster.gateway.output_subject, b"\x93garbage")
    await cluster.nc.publish(subjects.load_report("junk"), b"not msgpack")
    body = (await cluster.client.post(CHAT, json={"messages": HELLO})).json()
    assert body["choices"][0]["message"]["content"] == text_of(tokenizer, OUTPUT)
    assert len(llumlet.requests) == 1


async def test_unacknowledged_generate_is_a_503_and_aborted(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    await llumlet._subs.pop(0).unsubscribe()
    silent = await cluster.nc.subscribe(subjects.llumlet(llumlet.instance_id, "generate"))  # takes, never answers
    response = await cluster.client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 503 and "acknowledge" in response.json()["error"]["message"]
    await eventually(lambda: len(llumlet.aborts) == 1)
    await silent.unsubscribe()


async def test_stop_aborts_open_requests(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.emit = lambda request: [llumlet.chunk(request, 0, OUTPUT[:1]), 30.0]
    pending = asyncio.create_task(cluster.client.post(CHAT, json={"messages": HELLO}))
    while not llumlet.requests:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    cluster.gateway.fail_all("the gateway is shutting down")
    response = await pending
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
    await eventually(lambda: bool(llumlet.aborts))
    assert llumlet.aborts == [llumlet.requests[0].request_id]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_client_disconnect_over_real_http_aborts_the_request(cluster):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    llumlet.emit = lambda request: [llumlet.chunk(request, i, [t]) for i, t in enumerate(OUTPUT[:3])] + [30.0]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cluster.gateway), host="127.0.0.1", port=port,
                                           log_config=None, lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            async with client.stream("POST", CHAT, json={"messages": HELLO, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if '"content":"' in line and '"role"' not in line:
                        break  # first token seen; leave
        await eventually(lambda: bool(llumlet.aborts))
        assert llumlet.aborts == [llumlet.requests[0].request_id]
        assert len(cluster.gateway.streams) == 0
    finally:
        server.should_exit = True
        await serving


async def test_limits_are_the_smallest_live_instance_context(cluster):
    await cluster.llumlet("long", max_model_len=90)
    short = await cluster.llumlet("short", max_model_len=60)
    await cluster.until_alive(2)
    [card] = (await cluster.client.get("/v1/models")).json()["data"]
    assert card["max_model_len"] == 60  # not the model's 128
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "max_completion_tokens": 61})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "max_completion_tokens=61 cannot be greater than max_model_len=60. Please request fewer output "
                   "tokens.", "type": "BadRequestError", "param": "max_completion_tokens", "code": 400}
    response = await cluster.client.post("/v1/completions", json={"prompt": list(range(5, 75)), "max_tokens": 4})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt"
    assert error["message"] == ("This model's maximum context length is 60 tokens. However, your prompt contains 70 "
                                "input tokens, which exceeds this limit even without any output tokens. Please "
                                "reduce the length of the input prompt.")
    short.reporting = False  # gone: the limit follows the instances that are left
    await eventually(lambda: cluster.gateway.max_model_len == 90, timeout_s=5)


async def test_ready_only_with_a_live_instance(cluster):
    response = await cluster.client.get("/ready")
    assert response.status_code == 503 and response.json()["status"] == "no live instance"
    assert (await cluster.client.get("/health")).status_code == 200
    await cluster.llumlet("a")
    await cluster.llumlet("b")
    await cluster.until_alive(2)
    response = await cluster.client.get("/ready")
    assert response.status_code == 200 and response.json()["instances"] == 2 and response.json()["connected"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_n_choices_run_as_n_requests(cluster, tokenizer, stream):
    llumlet = await cluster.llumlet("a")
    await cluster.until_alive(1)
    response = await cluster.client.post(CHAT, json={"messages": HELLO, "n": 3, "max_tokens": 5, "seed": 7,
                                                     "stream": stream})
    assert response.status_code == 200
    assert len({r.request_id for r in llumlet.requests}) == 3
    assert sorted(r.sampling.seed for r in llumlet.requests) == [7, 8, 9]  # n equal seeds would give n equal choices
    expected = text_of(tokenizer, OUTPUT[:5])
    if not stream:
        body = response.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["message"]["content"] == expected and c["finish_reason"] == "length" for c in body["choices"])
        assert body["usage"]["completion_tokens"] == 15
        assert body["usage"]["prompt_tokens"] == len(llumlet.requests[0].prompt_token_ids)
        return
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    by_index: dict[int, list[dict]] = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == expected
        assert [c["finish_reason"] for c in choices][-1] == "length"
    assert len({c["id"] for c in chunks}) == 1
    await eventually(lambda: len(cluster.gateway.streams) == 0)
