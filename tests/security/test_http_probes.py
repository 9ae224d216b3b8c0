"""Hand-made hostile HTTP requests (issue 15's measured findings): each gets a clear OpenAI-shaped
4xx, never a 500, and the keep-alive connection it came on still serves the next request."""

from __future__ import annotations

import http.client
import json

import pytest

from services.gateway.protocol import MAX_MESSAGES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tests.security.http_gateway import scripted_gateway, served, tiny_model_dir

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]
BIG = 2**64  # past int64, what the wire and vLLM's seed take
MIB = 1024 * 1024


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def body(value: object) -> bytes:
    return json.dumps(value).encode()


# name -> (path, raw body, extra headers, expected status)
PROBES: dict[str, tuple[str, bytes, dict[str, str], int]] = {
    "nested 1,000 deep": (COMPLETIONS, f'{{"prompt": {nested(1000)}}}'.encode(), {}, 400),
    "nested 100,000 deep": (COMPLETIONS, nested(100_000).encode(), {}, 400),
    "nested objects 5,000 deep": (CHAT, ('{"a":' * 5000 + "1" + "}" * 5000).encode(), {}, 400),
    "seed 2**64": (COMPLETIONS, body({"prompt": "hi", "seed": BIG}), {}, 400),
    "seed -2**64": (COMPLETIONS, body({"prompt": "hi", "seed": -BIG}), {}, 400),
    "seed 1e300": (COMPLETIONS, b'{"prompt": "hi", "seed": 1e300}', {}, 400),
    "temperature 1e999": (COMPLETIONS, b'{"prompt": "hi", "temperature": 1e999}', {}, 400),
    "top_k 2**64": (COMPLETIONS, body({"prompt": "hi", "top_k": BIG}), {}, 400),
    "priority 2**100": (CHAT, body({"messages": HELLO, "priority": 2**100}), {}, 400),
    "stop_token_ids [2**64]": (CHAT, body({"messages": HELLO, "stop_token_ids": [BIG]}), {}, 400),
    "n 2**64": (CHAT, body({"messages": HELLO, "n": BIG}), {}, 400),
    "max_tokens 10**30": (CHAT, body({"messages": HELLO, "max_tokens": 10**30}), {}, 400),
    "max_tokens past the context": (CHAT, body({"messages": HELLO, "max_tokens": 10**6}), {}, 400),
    "logprobs 2**64": (COMPLETIONS, body({"prompt": "hi", "logprobs": BIG}), {}, 400),
    "prompt token ids 2**64": (COMPLETIONS, body({"prompt": [1, BIG]}), {}, 400),
    "X-Corral-Priority 2**70": (CHAT, body({"messages": HELLO}), {"X-Corral-Priority": str(2**70)}, 400),
    "X-Corral-Priority 9e9999": (CHAT, body({"messages": HELLO}), {"X-Corral-Priority": "9e9999"}, 400),
    "lone surrogate in a prompt": (COMPLETIONS, b'{"prompt": "ab\\ud800cd"}', {}, 400),
    "lone surrogate in a message": (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', {}, 400),
    "lone surrogate in the model": (CHAT, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
                                    {}, 400),
    "lone surrogate to /tokenize": ("/tokenize", b'{"prompt": "\\ud800"}', {}, 400),
    "lone surrogate in a stop string": (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}',
                                        {}, 400),
    "a UTF-8 byte order mark": (COMPLETIONS, b'\xef\xbb\xbf{"prompt": "hi"}', {}, 200),
    "NaN": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', {}, 400),
    "invalid UTF-8": (COMPLETIONS, b'{"prompt": "\xff\xfe\xc3("}', {}, 400),
    "empty body": (COMPLETIONS, b"", {}, 400),
    "JSON null": (CHAT, b"null", {}, 400),
    "a bare number": (CHAT, b"1e999999", {}, 400),
    f"{MAX_MESSAGES + 1} messages": (CHAT, body({"messages": HELLO * (MAX_MESSAGES + 1)}), {}, 400),
    "300k messages (over the body limit)": (CHAT, body({"messages": HELLO * 300_000}), {}, 413),
    "200k stop strings": (CHAT, body({"messages": HELLO, "stop": ["ab"] * 200_000}), {}, 400),
    f"{MAX_STOP_STRINGS + 1} stop strings": (CHAT, body({"messages": HELLO, "stop": ["ab"] * (MAX_STOP_STRINGS + 1)}),
                                             {}, 400),
    "a stop string too long": (CHAT, body({"messages": HELLO, "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}), {}, 400),
    "300k stop_token_ids": (CHAT, body({"messages": HELLO, "stop_token_ids": [1] * 300_000}), {}, 400),
    f"{MAX_STOP_TOKEN_IDS + 1} stop_token_ids": (
        CHAT, body({"messages": HELLO, "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}), {}, 400),
    "a 3 MB prompt (cannot fit the context)": (COMPLETIONS, body({"prompt": "word " * 600_000}), {}, 400),
    "a 3 MB chat message": (CHAT, body({"messages": [{"role": "user", "content": "x" * 3 * MIB}]}), {}, 400),
    "a 1M-token-id prompt": (COMPLETIONS, body({"prompt": [1] * 1_000_000}), {}, 400),
    "a 10 MB body": (COMPLETIONS, body({"prompt": "x" * 10 * MIB}), {}, 413),
    "detokenize ids past 64 bits": ("/detokenize", body({"tokens": [BIG] * 10}), {}, 400),
}


@pytest.fixture(scope="module")
def gateway_address(tmp_path_factory):
    gateway = scripted_gateway(tiny_model_dir(tmp_path_factory.mktemp("probes")))
    with served(gateway) as address:
        yield address


def assert_openai_error(status: int, raw: bytes) -> dict:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"] and error["type"].endswith("Error")
    return error


@pytest.mark.parametrize("name", list(PROBES))
def test_a_hostile_request_gets_a_clear_4xx_and_the_connection_lives_on(gateway_address, name):
    path, raw, headers, expected = PROBES[name]
    connection = http.client.HTTPConnection(*gateway_address, timeout=30)
    try:
        connection.request("POST", path, body=raw, headers={"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        answer = response.read()
        assert response.status == expected, (response.status, answer[:300])
        if expected >= 400:
            assert_openai_error(expected, answer)
        if expected == 413:
            return  # refused before its body was read: the server may close the connection
        socket_before = connection.sock
        assert socket_before is not None, "the gateway closed the connection"
        connection.request("GET", "/health")
        after = connection.getresponse()
        assert after.status == 200 and json.loads(after.read())["status"] == "ok"
        assert connection.sock is socket_before, "the next request needed a new connection"
    finally:
        connection.close()


def test_a_chunked_body_over_the_limit_is_a_413_while_it_is_read(tmp_path):
    """No Content-Length: the bound is counted as the chunks arrive, before any parsing."""
    gateway = scripted_gateway(tiny_model_dir(tmp_path), max_body_bytes=64 * 1024)
    with served(gateway) as address:
        connection = http.client.HTTPConnection(*address, timeout=30)
        chunks = (b'{"prompt": "' if i == 0 else b"x" * 8192 for i in range(40))
        connection.request("POST", COMPLETIONS, body=chunks, encode_chunked=True,
                           headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        response = connection.getresponse()
        error = assert_openai_error(413, response.read())
        assert response.status == 413 and "65536 bytes" in error["message"]
        connection.close()


def test_a_bug_is_a_500_that_keeps_the_connection(tmp_path):
    """The last resort: an unexpected exception is an OpenAI-shaped 500 and the client's next
    request on the same keep-alive connection is served (Starlette's own handler re-raises it,
    and uvicorn then drops the connection)."""
    gateway = scripted_gateway(tiny_model_dir(tmp_path))

    async def broken_submit(request):
        raise RuntimeError("a bug")

    gateway.submit = broken_submit  # type: ignore[method-assign]
    with served(gateway) as address:
        connection = http.client.HTTPConnection(*address, timeout=30)
        connection.request("POST", CHAT, body=body({"messages": HELLO}), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        error = assert_openai_error(500, response.read())
        assert "RuntimeError: a bug" in error["message"]
        socket_before = connection.sock
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200 and connection.sock is socket_before is not None
        connection.close()


def test_the_prompt_bound_refuses_in_vllms_words_before_tokenizing(tmp_path):
    gateway = scripted_gateway(tiny_model_dir(tmp_path))
    calls = []
    encode = gateway.tokenizer.encode
    gateway.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)  # type: ignore[method-assign]
    with served(gateway) as address:
        connection = http.client.HTTPConnection(*address, timeout=30)
        connection.request("POST", COMPLETIONS, body=body({"prompt": "word " * 200_000}),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        error = assert_openai_error(400, response.read())
        assert error["message"].startswith("This model's maximum context length is 256 tokens. However, your prompt "
                                           "contains at least ")
        assert error["param"] == "prompt" and calls == []
        connection.request("POST", COMPLETIONS, body=body({"prompt": "word " * 10}),
                           headers={"Content-Type": "application/json"})
        assert connection.getresponse().status == 200 and calls == [1]  # a prompt that may fit is tokenized
        connection.close()


def test_the_tokenizer_refuses_a_lone_surrogate_itself(tmp_path):
    """The JSON parser refuses "\\ud800" already; a caller that builds text otherwise (a chat
    template's input, a tool) still gets a PromptError, not the Rust tokenizer's TypeError."""
    from services.gateway.tokenizer import ModelTokenizer, PromptError

    tokenizer = ModelTokenizer.load(str(tiny_model_dir(tmp_path)))
    with pytest.raises(PromptError, match="not valid Unicode"):
        tokenizer.encode("ab\ud800")
    with pytest.raises(PromptError, match=r"messages\[1\].content is not valid Unicode"):
        tokenizer.apply_chat_template([{"role": "user", "content": "ok"}, {"role": "user", "content": "\udfff"}])
    tokenizer.close()
