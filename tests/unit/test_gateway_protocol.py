"""Request parsing and validation: every bad input is an OpenAI-style error with the right status.

The gateway here is not connected to NATS, so a request that passes validation ends in a 503
from `submit`: that tells "validated" apart from "rejected" without any instance.
"""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.protocol import (
    ApiError, RequestKind, parse_chat_request, parse_completion_request, parse_priority,
)
from services.gateway.service import GatewayService
from services.gateway.tokenizer import ModelTokenizer

MAX_MODEL_LEN = 64
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.tools.make_model import build_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tiny-tok"
    build_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": MAX_MODEL_LEN}))
    return path


@pytest.fixture(scope="module")
def service(model_dir):
    config = GatewayConfig(model_dir=str(model_dir), gateway_id="gw-test")
    return GatewayService(config, ModelTokenizer.load(str(model_dir)))


@pytest.fixture
async def client(service):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)), base_url="http://gw") as c:
        yield c


def assert_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == error_type and error["message"]
    return error


# ---- pure parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [(-1, -1), (3, 3), ("high", -1), ("normal", 0), ("HIGH", -1), ("-2", -2)])
def test_priority_accepts_integers_and_names(value, expected):
    assert parse_priority(value) == expected


@pytest.mark.parametrize("value", ["urgent", True, 1.5, None, ""])
def test_priority_rejects_anything_else(value):
    with pytest.raises(ApiError) as info:
        parse_priority(value)
    assert info.value.status == 400


@pytest.mark.parametrize("prompt, expected", [
    ("hi", "hi"), ([5, 6, 7], [5, 6, 7]), (["hi"], "hi"), ([[5, 6]], [5, 6]),
])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompt == expected


def test_sampling_fields_pass_through_to_the_engine():
    parsed = parse_chat_request({
        "messages": HELLO, "max_tokens": 9, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1,
        "min_p": 0.1, "seed": 42, "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [3, 4],
        "repetition_penalty": 1.2, "stop": "END", "priority": "high",
    })
    assert parsed.kind is RequestKind.CHAT and parsed.options.priority == -1 and parsed.options.stop == ("END",)
    sampling = parsed.options.sampling_params(parsed.options.max_tokens)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (7, 0.0, 0.5, 0)
    assert (sampling.min_p, sampling.seed, sampling.ignore_eos, sampling.min_tokens) == (0.1, 42, True, 2)
    assert (sampling.stop_token_ids, sampling.repetition_penalty) == ([3, 4], 1.2)


def test_text_parts_of_a_message_are_joined():
    parsed = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert parsed.messages == [{"role": "user", "content": "a\nb"}]


# ---- HTTP: malformed input --------------------------------------------------------------------

BAD_CHAT_BODIES = {
    "body not an object": [HELLO],
    "messages missing": {"model": "tiny-tok"},
    "messages empty": {"messages": []},
    "messages not a list": {"messages": "hello"},
    "message not an object": {"messages": ["hello"]},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "image content": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "user content null": {"messages": [{"role": "user", "content": None}]},
    "max_tokens zero": {"messages": HELLO, "max_tokens": 0},
    "max_tokens negative": {"messages": HELLO, "max_tokens": -5},
    "max_tokens text": {"messages": HELLO, "max_tokens": "10"},
    "max_completion_tokens zero": {"messages": HELLO, "max_completion_tokens": 0},
    "temperature text": {"messages": HELLO, "temperature": "hot"},
    "temperature negative": {"messages": HELLO, "temperature": -0.1},
    "top_p zero": {"messages": HELLO, "top_p": 0},
    "top_p above one": {"messages": HELLO, "top_p": 1.5},
    "top_k below -1": {"messages": HELLO, "top_k": -2},
    "min_p above one": {"messages": HELLO, "min_p": 2},
    "repetition_penalty zero": {"messages": HELLO, "repetition_penalty": 0},
    "seed a float": {"messages": HELLO, "seed": 1.5},
    "stream not a bool": {"messages": HELLO, "stream": "yes"},
    "stream_options without stream": {"messages": HELLO, "stream_options": {"include_usage": True}},
    "stream_options not an object": {"messages": HELLO, "stream": True, "stream_options": True},
    "stop a number": {"messages": HELLO, "stop": 3},
    "stop_token_ids not ints": {"messages": HELLO, "stop_token_ids": ["a"]},
    "min_tokens above max_tokens": {"messages": HELLO, "max_tokens": 2, "min_tokens": 5},
    "n above the cap": {"messages": HELLO, "n": 129},
    "top_logprobs without logprobs": {"messages": HELLO, "top_logprobs": 2},
    "top_logprobs 0 without logprobs": {"messages": HELLO, "top_logprobs": 0},
    "role an object": {"messages": [{"role": {}, "content": "hi"}]},
    "role a list": {"messages": [{"role": ["user"], "content": "hi"}]},
    "seed beyond int64": {"messages": HELLO, "seed": 2**63},
    "priority beyond int64": {"messages": HELLO, "priority": -(2**63) - 1},
    "priority text beyond int64": {"messages": HELLO, "priority": str(2**64)},
    "top_k beyond int32": {"messages": HELLO, "top_k": 2**31},
    "stop_token_ids beyond int32": {"messages": HELLO, "stop_token_ids": [2**31]},
    "top_logprobs above the max": {"messages": HELLO, "logprobs": True, "top_logprobs": 21},
    "logprobs not a boolean": {"messages": HELLO, "logprobs": 3},
    "presence_penalty": {"messages": HELLO, "presence_penalty": 0.5},
    "tools": {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]},
    "json response_format": {"messages": HELLO, "response_format": {"type": "json_object"}},
    "unknown priority": {"messages": HELLO, "priority": "urgent"},
    "max_tokens above the context": {"messages": HELLO, "max_tokens": MAX_MODEL_LEN + 1},
    "prompt fills the context": {"messages": [{"role": "user", "content": "x " * MAX_MODEL_LEN}]},
}


@pytest.mark.parametrize("body", BAD_CHAT_BODIES.values(), ids=BAD_CHAT_BODIES.keys())
async def test_bad_chat_request_is_a_400(client, body):
    assert_error(await client.post(CHAT, json=body), 400, "BadRequestError")


BAD_COMPLETION_BODIES = {
    "prompt missing": {"max_tokens": 3},
    "prompt empty": {"prompt": ""},
    "prompt empty list": {"prompt": []},
    "prompt a number": {"prompt": 7},
    "batched prompts": {"prompt": ["a", "b"]},
    "token id out of vocabulary": {"prompt": [1, 10**6]},
    "negative token id": {"prompt": [1, -3]},
    "echo": {"prompt": "hi", "echo": True},
    "logprobs above the max": {"prompt": "hi", "logprobs": 21},
    "logprobs not an integer": {"prompt": "hi", "logprobs": True},
    "suffix": {"prompt": "hi", "suffix": "end"},
    "best_of": {"prompt": "hi", "best_of": 3},
    "n above the cap": {"prompt": "hi", "n": 1000},
    "prompt too long": {"prompt": list(range(10, 10 + MAX_MODEL_LEN))},
}


@pytest.mark.parametrize("body", BAD_COMPLETION_BODIES.values(), ids=BAD_COMPLETION_BODIES.keys())
async def test_bad_completion_request_is_a_400(client, body):
    assert_error(await client.post(COMPLETIONS, json=body), 400, "BadRequestError")


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"messages": '])
async def test_body_that_is_not_json_is_a_400(client, raw):
    response = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, "BadRequestError")


async def test_unknown_priority_header_is_a_400(client):
    response = await client.post(CHAT, json={"messages": HELLO}, headers={"X-Corral-Priority": "urgent"})
    assert assert_error(response, 400, "BadRequestError")["param"] == "X-Corral-Priority"


async def test_body_priority_wins_over_a_bad_header(client):
    response = await client.post(CHAT, json={"messages": HELLO, "priority": 0}, headers={"X-Corral-Priority": "urgent"})
    assert_error(response, 503, "ServiceUnavailableError")


async def test_unknown_model_is_a_404(client):
    error = assert_error(await client.post(CHAT, json={"model": "gpt-7", "messages": HELLO}), 404, "NotFoundError")
    assert "gpt-7" in error["message"]


async def test_unknown_route_and_wrong_method_are_json_errors(client):
    assert_error(await client.get("/v1/nothing"), 404, "NotFoundError")
    assert_error(await client.get(CHAT), 405, "MethodNotAllowedError")


# ---- HTTP: valid input reaches dispatch ----------------------------------------------------------


@pytest.mark.parametrize("path, body, prompt, expected", [
    (CHAT, {"model": "tiny-tok", "messages": HELLO, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}},
     lambda tok: tok.apply_chat_template(HELLO), dict(max_tokens=4, stream=True, include_usage=True)),
    (CHAT, {"messages": [{"role": "system", "content": "be brief"}, *HELLO,
                         {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]},
     None, dict(stream=False, include_usage=False)),
    (CHAT, {"messages": HELLO, "unknown_field": {"is": "ignored"}, "n": 1, "presence_penalty": 0},
     lambda tok: tok.apply_chat_template(HELLO), dict(stream=False)),
    (CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
            "response_format": {"type": "text"}},
     lambda tok: tok.apply_chat_template(HELLO), {}),
    (COMPLETIONS, {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 2, "priority": "normal"},
     lambda tok: tok.encode("hello"), dict(max_tokens=MAX_MODEL_LEN - 2)),
    (COMPLETIONS, {"prompt": [1, 5, 9], "max_tokens": None, "temperature": None},
     lambda tok: [1, 5, 9], dict(max_tokens=MAX_MODEL_LEN - 3, temperature=1.0)),
])
async def test_valid_request_passes_validation(client, service, monkeypatch, path, body, prompt, expected):
    """It reaches `submit` (a 503 here: no NATS) parsed as sent: the prompt as the tokenizer
    makes it, the options, the priority and the output budget (max_tokens, at most the room left)."""
    submitted = []
    real_submit = service.submit

    async def record(request):
        submitted.append(request)
        return await real_submit(request)

    monkeypatch.setattr(service, "submit", record)
    error = assert_error(await client.post(path, json=body), 503, "ServiceUnavailableError")
    assert "not connected" in error["message"]
    [request] = submitted
    assert request.kind is (RequestKind.CHAT if path == CHAT else RequestKind.COMPLETION)
    if prompt is not None:
        assert request.prompt_token_ids == prompt(service.tokenizer)
    else:  # the system turn and both user turns are in the prompt (the empty assistant turn adds nothing)
        text = service.tokenizer.decode(request.prompt_token_ids)
        assert all(part in text for part in ("be brief", "hello", "again")), text
    assert request.priority == 0
    room = MAX_MODEL_LEN - len(request.prompt_token_ids)
    assert request.max_tokens == min(expected.get("max_tokens", room), room)  # clamped to the room left
    for field in ("stream", "include_usage", "temperature"):
        if field in expected:
            assert getattr(request.options, field) == expected[field], field


async def test_model_may_be_named_by_its_path(client, model_dir):
    response = await client.post(CHAT, json={"model": str(model_dir), "messages": HELLO})
    assert_error(response, 503, "ServiceUnavailableError")


async def test_models_lists_the_served_model(client):
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "tiny-tok" and card["object"] == "model" and card["owned_by"] == "corral"
    assert card["max_model_len"] == MAX_MODEL_LEN and isinstance(card["created"], int)


async def test_health_is_liveness_and_ready_is_503_without_nats(client):
    for path in ("/health", "/healthz"):
        assert (await client.get(path)).status_code == 200  # the process serves: alive
    response = await client.get("/ready")
    assert response.status_code == 503
    assert response.json() == {"status": "not connected to NATS", "gateway_id": "gw-test", "connected": False,
                               "instances": 0}


async def test_metrics_counts_requests_by_status(client):
    await client.post(CHAT, json={"messages": []})
    text = (await client.get("/metrics")).text
    assert 'corral:gateway_requests_total{endpoint="/v1/chat/completions",model_name="tiny-tok",status="400"}' in text
    assert "corral:gateway_bypass_dispatches_total 0.0" in text
    assert "corral:gateway_instances_alive 0.0" in text
