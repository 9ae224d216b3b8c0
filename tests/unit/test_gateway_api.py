"""The API surface around generation, as vLLM's users expect it: SSE timing, request ids, API keys,
CORS, models/{id} (through the real openai SDK), version, tokenize/detokenize and /openapi.json.

Instances are scripted as in test_gateway_sse (no NATS); SSE timing is measured over real HTTP.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
from msgspec.structs import replace
import openai
import pytest
import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from shared.messages import FinishReason, TokenChunk, TokenLogprob
from tests.support.cluster import free_port
from tests.unit.test_gateway_sse import (  # noqa: F401  (tokenizer is a fixture)
    CHAT, HELLO, TEXT, ScriptedGateway, chunks_for, sse_events, token_ids, tokenizer,
)

KEYS = ("key-one", "key-two")


def make_gateway(tokenizer, tmp_path, **config) -> ScriptedGateway:
    config = GatewayConfig(model_dir=str(tmp_path / "tiny-tok"), gateway_id="gw-test", request_inactivity_timeout_s=2.0,
                           **config)
    return ScriptedGateway(config, tokenizer)


def client_for(gateway: ScriptedGateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gw")


@pytest.fixture
def gateway(tokenizer, tmp_path) -> ScriptedGateway:
    return make_gateway(tokenizer, tmp_path)


@pytest.fixture
async def client(gateway):
    async with client_for(gateway) as c:
        yield c


# ---- SSE timing --------------------------------------------------------------------------------


async def test_role_chunk_goes_out_with_the_first_token_not_before(gateway, tokenizer):
    """vllm bench serve times TTFT to the first chunk: a role chunk sent at once would read as a
    TTFT of ~0 while the engine is still prefilling."""
    prefill_s = 0.4
    gateway.script = [prefill_s, *chunks_for(token_ids(tokenizer, TEXT))]
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(gateway), host="127.0.0.1", port=port, log_config=None,
                                           lifespan="off"))
    serving = asyncio.create_task(server.serve())
    arrivals: list[tuple[float, dict]] = []
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            started = time.monotonic()
            async with http.stream("POST", CHAT, json={"messages": HELLO, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append((time.monotonic() - started, json.loads(line[len("data: "):])))
    finally:
        server.should_exit = True
        await serving
    (role_at, role), (first_at, first) = arrivals[0], arrivals[1]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"]["content"]
    assert role_at >= prefill_s * 0.9  # not at once: only when the first token is there
    assert first_at - role_at < 0.005  # and immediately before it


async def test_a_stream_that_fails_before_any_token_sends_no_role_chunk(client, gateway):
    gateway.script = [TokenChunk("?", "inst-a", 0, [], error="the engine failed")]
    response = await client.post(CHAT, json={"messages": HELLO, "stream": True})
    events = sse_events(response.text)
    assert "error" in json.loads(events[0]) and events[-1] == "[DONE]"
    assert not any('"role"' in e for e in events)


# ---- request ids -------------------------------------------------------------------------------


async def test_request_id_is_generated_when_absent_and_ends_the_response_id(client, gateway, tokenizer):
    gateway.script = chunks_for(token_ids(tokenizer, "hi"))
    response = await client.post(CHAT, json={"messages": HELLO})
    request_id = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert response.json()["id"] == f"chatcmpl-{request_id}"


async def test_request_id_given_is_returned_on_every_route_and_error(client):
    for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                               ("POST", CHAT, {"messages": []}), ("GET", "/v1/nothing-here", None)):
        response = await client.request(method, path, json=body, headers={"X-Request-Id": "mine-42"})
        assert response.headers["x-request-id"] == "mine-42", path
        assert response.headers.get_list("x-request-id") == ["mine-42"]


# ---- API keys ----------------------------------------------------------------------------------


@pytest.fixture
async def keyed(tokenizer, tmp_path):
    gateway = make_gateway(tokenizer, tmp_path, api_keys=KEYS)
    async with client_for(gateway) as c:
        yield c


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Bearer key-on", "key-one", "Basic key-one"])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/v1/models/tiny-tok"),
                                          ("POST", CHAT), ("POST", "/v1/completions")])
async def test_v1_routes_need_a_valid_key(keyed, method, path, authorization):
    headers = {"authorization": authorization} if authorization else {}
    response = await keyed.request(method, path, json={"messages": HELLO}, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "AuthenticationError" and response.json()["error"]["code"] == 401
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", KEYS)
async def test_each_key_opens_v1(keyed, key):
    response = await keyed.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/health", "/healthz", "/ready", "/metrics", "/version", "/openapi.json"])
async def test_health_readiness_metrics_and_docs_stay_open(keyed, path):
    assert (await keyed.get(path)).status_code in (200, 503)  # /ready: 503, no NATS here; never 401


def test_keys_never_appear_in_the_config_repr():
    config = GatewayConfig(model_dir="/m", api_keys=KEYS)
    assert "key-one" not in repr(config) and "key-one" not in str(config)


# ---- CORS --------------------------------------------------------------------------------------


PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}


async def test_preflight_is_answered_for_an_allowed_origin_even_with_keys(tokenizer, tmp_path):
    gateway = make_gateway(tokenizer, tmp_path, api_keys=KEYS, allowed_origins=("https://ui.example",))
    async with client_for(gateway) as c:
        response = await c.options(CHAT, headers={"origin": "https://ui.example", **PREFLIGHT})
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://ui.example"
        assert "POST" in response.headers["access-control-allow-methods"]
        denied = await c.get("/v1/models", headers={"origin": "https://ui.example"})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://ui.example"
        other = await c.options(CHAT, headers={"origin": "https://evil.example", **PREFLIGHT})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


async def test_cross_origin_access_is_off_by_default_as_in_vllm(client):
    response = await client.options(CHAT, headers={"origin": "https://ui.example", **PREFLIGHT})
    assert response.status_code == 400 and "access-control-allow-origin" not in response.headers


# ---- models, version, tokenize -----------------------------------------------------------------


async def test_openai_sdk_retrieves_the_model_and_gets_not_found_for_others(tokenizer, tmp_path):
    gateway = make_gateway(tokenizer, tmp_path, api_keys=KEYS)
    async with client_for(gateway) as http:
        sdk = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="key-two", http_client=http, max_retries=0)
        model = await sdk.models.retrieve("tiny-tok")
        assert model.id == "tiny-tok" and model.object == "model" and model.owned_by == "corral"
        with pytest.raises(openai.NotFoundError) as info:
            await sdk.models.retrieve("org/other-model")
        assert info.value.body["param"] == "model" and "does not exist" in info.value.body["message"]
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url="http://gw/v1", api_key="nope", http_client=http,
                                     max_retries=0).models.retrieve("tiny-tok")


async def test_version(client):
    assert (await client.get("/version")).json() == {"version": "0.1.0"}


async def test_tokenize_a_prompt_and_messages_as_vllm_does(client, tokenizer):
    body = (await client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True})).json()
    assert body["tokens"] == tokenizer.encode(TEXT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and body["token_strs"] == tokenizer.token_strings(body["tokens"])
    bare = (await client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False})).json()
    assert bare["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False) and bare["token_strs"] is None
    chat = (await client.post("/tokenize", json={"messages": HELLO})).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(HELLO)


async def test_detokenize_round_trips(client, tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert (await client.post("/detokenize", json={"tokens": ids})).json() == {"prompt": TEXT}


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/tokenize", {"messages": "hi"}),
    ("/tokenize", {"messages": HELLO, "continue_final_message": True}),
    ("/detokenize", {"tokens": "abc"}), ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": [10**9]}),
    ("/detokenize", [1, 2]),
])
async def test_bad_tokenize_bodies_are_400s(client, path, body):
    response = await client.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"


async def test_tokenize_unknown_model_is_a_404(client):
    assert (await client.post("/tokenize", json={"prompt": "hi", "model": "other"})).status_code == 404


# ---- /openapi.json -----------------------------------------------------------------------------


async def test_openapi_document_is_valid_and_describes_every_route(client, gateway):
    validator = pytest.importorskip("openapi_spec_validator")
    document = (await client.get("/openapi.json")).json()
    validator.validate(document)
    app = create_app(gateway)
    served = {(route.path.replace("{model:path}", "{model}"), method.lower())
              for route in app.routes for method in route.methods if method != "HEAD"}
    described = {(path, method) for path, item in document["paths"].items() for method in item}
    assert served == described
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"400", "401", "429", "503"} <= set(chat["responses"])


async def test_bodies_valid_by_the_schema_are_accepted(client, gateway, tokenizer):
    """The schema and the parser agree on what a good body is (a parser stricter than its schema
    would turn a fuzzer's valid bodies into 400s)."""
    jsonschema = pytest.importorskip("jsonschema")
    document = (await client.get("/openapi.json")).json()
    bodies = {
        CHAT: {"messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "n": 2, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0.5, "seed": 3, "stop": ["x"],
               "stop_token_ids": [0], "priority": "high", "max_completion_tokens": 4, "ignore_eos": True,
               "min_tokens": 1, "repetition_penalty": 1.1, "include_stop_str_in_output": False},
        "/v1/completions": {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                            "stream_options": {"include_usage": True}},
    }
    for path, body in bodies.items():
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        jsonschema.validate(body, {**schema, "components": document["components"]})
        gateway.script = chunks_for(token_ids(tokenizer, "ok"))
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text


# ---- n > 1 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_one_failed_choice_fails_the_request_at_once_and_aborts_the_others(client, gateway, stream):
    scripts = iter([[4.0], [TokenChunk("?", "inst-a", 0, [], error="the engine failed")], [4.0]])
    feed = gateway._feed
    gateway._feed = lambda request_id, script: feed(request_id, next(scripts))
    started = time.monotonic()
    response = await client.post(CHAT, json={"messages": HELLO, "n": 3, "stream": stream})
    assert time.monotonic() - started < 2  # not after the slow choices
    if stream:
        events = sse_events(response.text)
        assert json.loads(events[-2])["error"]["message"] == "the engine failed" and events[-1] == "[DONE]"
    else:
        assert response.status_code == 500 and response.json()["error"]["message"] == "the engine failed"
    slow = {gateway.submitted[0].request_id, gateway.submitted[2].request_id}
    assert slow <= set(gateway.aborted) and len(gateway.streams) == 0


# ---- logprobs ----------------------------------------------------------------------------------


def with_logprobs(chunks: list[TokenChunk], top: int) -> list[TokenChunk]:
    """Each token i gets logprob -(i+1)/10, and alternatives: itself, then token 3, 4, ..."""
    out = []
    for chunk in chunks:
        logprobs = []
        for offset, token_id in enumerate(chunk.token_ids):
            value = -(chunk.start_index + offset + 1) / 10
            alternatives = [(token_id, value)] + [(3 + k, value - 1 - k) for k in range(top - 1)]
            logprobs.append(TokenLogprob(value, alternatives[:top]))
        out.append(replace(chunk, logprobs=logprobs))
    return out


async def test_chat_stream_logprobs_in_openai_shape(client, gateway, tokenizer):
    ids = token_ids(tokenizer, TEXT)
    gateway.script = with_logprobs(chunks_for(ids), top=2)
    response = await client.post(CHAT, json={"messages": HELLO, "stream": True, "logprobs": True, "top_logprobs": 2})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    assert gateway.submitted[0].options.sampling_params(8).logprobs == 2  # asked of the engine
    entries = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in entries] == [tokenizer.token_text(t) for t in ids]
    assert [e["logprob"] for e in entries] == pytest.approx([-(i + 1) / 10 for i in range(len(ids))])
    first = entries[0]
    assert first["bytes"] == list(first["token"].encode())
    assert [t["token"] for t in first["top_logprobs"]] == [first["token"], tokenizer.token_text(3)]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk


async def test_completion_logprobs_with_text_offsets(client, gateway, tokenizer):
    ids = token_ids(tokenizer, "Hello world again")
    gateway.script = with_logprobs(chunks_for(ids, finish=FinishReason.LENGTH), top=1)
    body = (await client.post("/v1/completions", json={"prompt": "hi", "logprobs": 1, "max_tokens": len(ids)})).json()
    logprobs = body["choices"][0]["logprobs"]
    texts = [tokenizer.token_text(t) for t in ids]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == pytest.approx([-(i + 1) / 10 for i in range(len(ids))])
    assert [list(d) for d in logprobs["top_logprobs"]] == [[t] for t in texts]
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(ids))]


async def test_logprobs_stop_at_a_stop_string_with_the_text(client, gateway, tokenizer):
    ids = token_ids(tokenizer, "one two three four")
    gateway.script = with_logprobs(chunks_for(ids, per_chunk=4), top=0)
    body = (await client.post("/v1/completions", json={"prompt": "hi", "logprobs": 0, "stop": " three"})).json()
    assert body["choices"][0]["text"] == "one two"
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert "".join(tokens).startswith("one two three") and len(tokens) < len(ids)  # up to the stop, no further


async def test_tokens_repeated_at_a_handover_without_logprobs_have_null_ones(client, gateway, tokenizer):
    ids = token_ids(tokenizer, "one two three four")
    source = with_logprobs([TokenChunk("?", "src", 0, ids[:2])], top=1)
    # The destination's repeat of the output so far overtakes the source's last chunk.
    handover = TokenChunk("?", "dst", 0, ids[:3], handover=True)
    rest = with_logprobs([TokenChunk("?", "dst", 3, ids[3:], finish_reason=FinishReason.STOP)], top=1)
    gateway.script = [*source, handover, *rest]
    body = (await client.post(CHAT, json={"messages": HELLO, "logprobs": True})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] is None for e in content] == [False, False, True] + [False] * (len(ids) - 3)
    assert content[2]["top_logprobs"] == []


async def test_answers_match_their_documented_schemas(client, gateway, tokenizer):
    jsonschema = pytest.importorskip("jsonschema")
    document = (await client.get("/openapi.json")).json()

    def check(path: str, method: str, response: httpx.Response) -> None:
        answer = document["paths"][path][method]["responses"][str(response.status_code)]
        schema = answer["content"]["application/json"]["schema"]
        jsonschema.validate(response.json(), {**schema, "components": document["components"]})

    ids = token_ids(tokenizer, "Hello world")
    gateway.script = with_logprobs(chunks_for(ids), top=2)
    check(CHAT, "post", await client.post(CHAT, json={"messages": HELLO, "n": 2, "logprobs": True, "top_logprobs": 2}))
    gateway.script = with_logprobs(chunks_for(ids), top=1)
    check("/v1/completions", "post", await client.post("/v1/completions", json={"prompt": "hi", "logprobs": 1}))
    check(CHAT, "post", await client.post(CHAT, json={"messages": []}))  # a 400
    check("/v1/models", "get", await client.get("/v1/models"))
    check("/v1/models/{model}", "get", await client.get("/v1/models/tiny-tok"))
    check("/v1/models/{model}", "get", await client.get("/v1/models/other"))  # a 404
    check("/tokenize", "post", await client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}))
    check("/detokenize", "post", await client.post("/detokenize", json={"tokens": ids}))
    for path in ("/health", "/ready", "/version"):
        check(path, "get", await client.get(path))
