"""Gateway API keys (issue 15, point 5): 401 on every /v1 route without a valid key; keys from a
flag, the environment or a file; a key never reaches a log line or an error message."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import time

import pytest

from services.gateway.config import ConfigError, add_arguments, config_from_args
from tests.security.http_gateway import scripted_gateway, served, tiny_model_dir
from tests.unit.test_gateway_sse import chunks_for

SECRET_FILE_KEY = "sk-from-the-file-3f9a"
SECRET_ENV_KEY = "sk-from-the-env-77c1"
V1_ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
             ("GET", "/v1/models/tiny-tok"), ("GET", "/v1/models/other")]


def parse(argv: list[str], env: dict[str, str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv), env)


def test_keys_come_from_a_file_the_environment_and_flags_together(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# one key a line\n\n  {SECRET_FILE_KEY}  \nsk-second\n")
    config = parse(["--model", str(tmp_path), "--api-key-file", str(key_file), "--api-key", "sk-flag"],
                   {"CORRAL_API_KEY": SECRET_ENV_KEY})
    assert set(config.api_keys) == {"sk-flag", SECRET_FILE_KEY, "sk-second"}  # a flag wins over the env
    config = parse(["--model", str(tmp_path)], {"CORRAL_API_KEY": SECRET_ENV_KEY,
                                                  "CORRAL_API_KEY_FILE": str(key_file)})
    assert set(config.api_keys) == {SECRET_ENV_KEY, SECRET_FILE_KEY, "sk-second"}
    assert SECRET_FILE_KEY not in repr(config) and SECRET_ENV_KEY not in repr(config)


@pytest.mark.parametrize("content", ["", "# only a comment\n\n"])
def test_a_key_file_without_keys_or_unreadable_is_a_clear_error(tmp_path, content):
    key_file = tmp_path / "keys"
    key_file.write_text(content)
    with pytest.raises(ConfigError, match="holds no key"):
        parse(["--model", str(tmp_path), "--api-key-file", str(key_file)], {})
    with pytest.raises(ConfigError, match="cannot read the API key file"):
        parse(["--model", str(tmp_path), "--api-key-file", str(tmp_path / "missing")], {})


@pytest.fixture(scope="module")
def keyed_gateway(tmp_path_factory):
    home = tmp_path_factory.mktemp("keys")
    key_file = home / "keys"
    key_file.write_text(SECRET_FILE_KEY + "\n")
    gateway = scripted_gateway(tiny_model_dir(home), api_keys=(SECRET_ENV_KEY,), api_key_file=str(key_file))
    with served(gateway) as address:
        yield address


def call(address, method: str, path: str, authorization: str | None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(*address, timeout=30)
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    body = None
    if method == "POST":
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("method,path", V1_ROUTES)
@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", "Bearer wrong", f"Basic {SECRET_FILE_KEY}",
                                           f"Bearer {SECRET_FILE_KEY}x", f"Bearer {SECRET_FILE_KEY[:-1]}"])
def test_every_v1_route_is_a_401_without_a_valid_key(keyed_gateway, caplog, method, path, authorization):
    caplog.set_level(logging.DEBUG)
    status, body = call(keyed_gateway, method, path, authorization)
    error = json.loads(body)["error"]
    assert status == 401 and error["code"] == 401 and error["type"] == "AuthenticationError"
    assert SECRET_FILE_KEY not in body.decode() and SECRET_FILE_KEY not in caplog.text


@pytest.mark.parametrize("key", [SECRET_FILE_KEY, SECRET_ENV_KEY])
def test_each_key_opens_v1_and_is_never_logged(keyed_gateway, caplog, key):
    caplog.set_level(logging.DEBUG)
    for method, path in V1_ROUTES:
        status, body = call(keyed_gateway, method, path, f"Bearer {key}")
        assert status == (404 if path.endswith("other") else 200), (path, body[:200])
        assert key not in body.decode()
    assert key not in caplog.text


def test_a_key_past_its_streams_gets_a_429_and_other_keys_do_not(tmp_path):
    gateway = scripted_gateway(tiny_model_dir(tmp_path), api_keys=("sk-a", "sk-b"), max_streams_per_key=2)
    first, *rest = chunks_for([40, 41, 42, 43])
    gateway.script = [first, 1.5, *rest]  # each stream stays open ~1.5 s
    with served(gateway) as address:
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        held = []
        for _ in range(2):
            connection = http.client.HTTPConnection(*address, timeout=30)
            connection.request("POST", "/v1/chat/completions", body=chat,
                               headers={"Authorization": "Bearer sk-a", "Content-Type": "application/json"})
            assert connection.getresponse().status == 200
            held.append(connection)
        status, body = call(address, "POST", "/v1/chat/completions", "Bearer sk-a")
        error = json.loads(body)["error"]
        assert status == 429 and error["type"] == "RateLimitError" and "--max-streams-per-key" in error["message"]
        assert call(address, "POST", "/v1/chat/completions", "Bearer sk-b")[0] == 200  # another key's own count
        assert call(address, "GET", "/v1/models", "Bearer sk-a")[0] == 200  # only generation counts
        for connection in held:
            connection.close()  # the client leaves: its streams end
        deadline = time.monotonic() + 10
        while call(address, "POST", "/v1/chat/completions", "Bearer sk-a")[0] == 429:
            assert time.monotonic() < deadline, "the key's streams were never released"
            time.sleep(0.1)


def test_streams_per_key_need_keys(tmp_path):
    with pytest.raises(ConfigError, match="needs API keys"):
        parse(["--model", str(tmp_path), "--max-streams-per-key", "4"], {})
