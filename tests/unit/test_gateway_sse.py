"""Response formats (SSE chunks, full objects), stop strings, mid-stream errors and aborts.

The instance side is faked: `ScriptedGateway.submit` opens the request's stream and feeds it
scripted token chunks, exactly as the NATS callback would.
"""

from __future__ import annotations

import asyncio
import json
from msgspec.structs import replace

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.prepared import PreparedRequest
from services.gateway.service import GatewayService
from services.gateway.streams import OutputStream
from services.gateway.tokenizer import ModelTokenizer
from shared.messages import FinishReason, TokenChunk

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]
TEXT = "Hello, world! 😀 大型"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> ModelTokenizer:
    from services.tools.make_model import build_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tiny-tok"
    build_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    return ModelTokenizer.load(str(path))


class ScriptedGateway(GatewayService):
    """Each request gets `script(request)`: token chunks (or float pauses) fed into its stream."""

    def __init__(self, config: GatewayConfig, tokenizer: ModelTokenizer) -> None:
        super().__init__(config, tokenizer)
        self.script: list[TokenChunk | float] = []
        self.aborted: list[str] = []
        self.submitted: list[PreparedRequest] = []
        self._feeders: list[asyncio.Task] = []

    async def submit(self, request: PreparedRequest) -> OutputStream:
        self.submitted.append(request)
        stream = self.streams.open(request.request_id)
        self._feeders.append(asyncio.create_task(self._feed(request.request_id, list(self.script))))
        return stream

    async def _feed(self, request_id: str, script: list[TokenChunk | float]) -> None:
        for step in script:
            if isinstance(step, float):
                await asyncio.sleep(step)
            else:
                self.streams.route(replace(step, request_id=request_id))
                await asyncio.sleep(0)

    def _publish_abort(self, request_id: str, reason: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture
def gateway(tokenizer, tmp_path) -> ScriptedGateway:
    config = GatewayConfig(model_dir=str(tmp_path / "tiny-tok"), gateway_id="gw-test", request_inactivity_timeout_s=0.5)
    return ScriptedGateway(config, tokenizer)


@pytest.fixture
async def client(gateway):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw") as c:
        yield c


def token_ids(tokenizer: ModelTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def chunks_for(ids: list[int], per_chunk: int = 2, finish: FinishReason | None = FinishReason.STOP) -> list[TokenChunk]:
    starts = range(0, len(ids), per_chunk)
    out = [TokenChunk("?", "inst-a", s, ids[s:s + per_chunk]) for s in starts]
    if finish is not None:
        out[-1] = replace(out[-1], finish_reason=finish)
    return out


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


async def test_chat_stream_chunks_follow_the_openai_format(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = chunks_for(ids)
    response = await client.post(CHAT, json={"messages": HELLO, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny-tok" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == TEXT
    assert not any("usage" in c for c in chunks)


async def test_include_usage_adds_a_last_chunk_without_choices(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = chunks_for(ids)
    response = await client.post(CHAT, json={"messages": HELLO, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(response.text)
    usage_chunk = json.loads(events[-2])
    prompt_len = len(gateway.submitted[0].prompt_token_ids)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(ids),
                                    "total_tokens": prompt_len + len(ids)}


async def test_completion_stream_has_text_choices_and_no_role_chunk(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = chunks_for(ids, finish=FinishReason.LENGTH)
    response = await client.post(COMPLETIONS, json={"prompt": "Say", "stream": True})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_without_stream_returns_one_completion_object(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = chunks_for(ids)
    body = (await client.post(CHAT, json={"messages": HELLO, "max_tokens": 50})).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": TEXT}, "logprobs": None,
                                "finish_reason": "stop"}]
    prompt_len = len(gateway.submitted[0].prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(ids),
                             "total_tokens": prompt_len + len(ids)}
    assert gateway.submitted[0].max_tokens == 50


async def test_completion_without_stream_returns_a_text_completion(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = chunks_for(ids, finish=FinishReason.LENGTH)
    body = (await client.post(COMPLETIONS, json={"prompt": [1, 40, 41]})).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == TEXT and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3
    assert gateway.submitted[0].max_tokens == 256 - 3  # vLLM's default: the rest of the context


async def test_engine_finish_needs_no_abort(client, gateway, tokenizer):
    gateway.script = chunks_for(token_ids(tokenizer, TEXT))
    await client.post(CHAT, json={"messages": HELLO})
    assert gateway.aborted == [] and len(gateway.streams) == 0


async def test_stop_string_truncates_the_text_and_aborts_upstream(client, gateway, tokenizer):
    ids = token_ids(tokenizer, "one two STOP three four")
    gateway.script = chunks_for(ids, per_chunk=1, finish=None)  # the engine would go on
    body = (await client.post(CHAT, json={"messages": HELLO, "stop": ["STOP"]})).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "one two " and choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(token_ids(tokenizer, "one two STOP"))
    assert gateway.aborted == [gateway.submitted[0].request_id]


async def test_stop_string_in_a_stream_never_leaks_a_partial_match(client, gateway, tokenizer):
    gateway.script = chunks_for(token_ids(tokenizer, "alpha ENDbeta"), per_chunk=1, finish=None)
    response = await client.post(COMPLETIONS, json={"prompt": "x", "stream": True, "stop": "ENDbeta"})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "alpha "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_mid_stream_error_is_an_error_event_then_done(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = [TokenChunk("?", "inst-a", 0, ids[:3]), TokenChunk("?", "inst-a", 3, [], error="engine crashed")]
    events = sse_events((await client.post(CHAT, json={"messages": HELLO, "stream": True})).text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "engine crashed" and error["code"] == 500 and error["type"] == "InternalServerError"
    assert gateway.aborted == [gateway.submitted[0].request_id]


async def test_error_without_stream_is_an_http_error(client, gateway):
    gateway.script = [TokenChunk("?", "inst-a", 0, [], error="engine crashed")]
    response = await client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 500 and response.json()["error"]["message"] == "engine crashed"


async def test_silence_past_the_inactivity_timeout_fails_the_request(client, gateway):
    gateway.script = []
    response = await client.post(CHAT, json={"messages": HELLO})
    assert response.status_code == 504 and "no output" in response.json()["error"]["message"]
    assert len(gateway.aborted) == 1


async def test_reordered_chunks_from_two_instances_give_the_text_once(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    a, b = ids[:5], ids[3:]
    gateway.script = [
        TokenChunk("?", "inst-b", 3, b, finish_reason=FinishReason.STOP),  # the destination, early
        TokenChunk("?", "inst-a", 0, a),  # the source, late and overlapping
    ]
    body = (await client.post(CHAT, json={"messages": HELLO})).json()
    assert body["choices"][0]["message"]["content"] == TEXT
    assert body["usage"]["completion_tokens"] == len(ids)


async def test_x_request_id_names_the_response(client, gateway, tokenizer):
    gateway.script = chunks_for(token_ids(tokenizer, "hi"))
    response = await client.post(CHAT, json={"messages": HELLO}, headers={"X-Request-Id": "trace-42"})
    assert response.json()["id"] == "chatcmpl-trace-42" and response.headers["x-request-id"] == "trace-42"
    assert gateway.submitted[0].request_id != "chatcmpl-trace-42"  # internal ids stay unique


async def test_priority_header_applies_when_the_body_has_none(client, gateway, tokenizer):
    gateway.script = chunks_for(token_ids(tokenizer, "hi"))
    await client.post(CHAT, json={"messages": HELLO}, headers={"X-Corral-Priority": "high"})
    gateway.script = chunks_for(token_ids(tokenizer, "hi"))
    await client.post(CHAT, json={"messages": HELLO, "priority": 5}, headers={"X-Corral-Priority": "high"})
    assert [r.priority for r in gateway.submitted] == [-1, 5]


async def test_client_disconnect_mid_stream_aborts_upstream(gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = [TokenChunk("?", "inst-a", 0, ids[:2]), 30.0]  # then silence
    app = create_app(gateway)
    body = json.dumps({"messages": HELLO, "stream": True}).encode()
    first_chunk = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await first_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            first_chunk.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1),
             "server": ("gw", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert gateway.aborted == [gateway.submitted[0].request_id]
    assert len(gateway.streams) == 0
    assert 'status="499"' in gateway.metrics.render().decode()
