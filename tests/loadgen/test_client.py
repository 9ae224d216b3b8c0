"""The HTTP side without a server: SSE parsing, request bodies, endpoint URLs."""

from __future__ import annotations

import pytest

from loadgen.client import EndpointConfig, build_payload, normalize_base_url, sse_events
from loadgen.errors import LoadgenError
from loadgen.schedule import ScheduledRequest


async def _lines(*lines: str):
    for line in lines:
        yield line


async def _events(*lines: str) -> list[str]:
    return [event async for event in sse_events(_lines(*lines))]


async def test_sse_skips_comments_and_joins_multiline_data() -> None:
    events = await _events(
        ": keep-alive", "", 'data: {"a": 1}', "", "data:x", "data: y", "", "event: ping", "", "data: [DONE]"
    )
    assert events == ['{"a": 1}', "x\ny", "[DONE]"]


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("http://h:8000", "http://h:8000"),
        ("http://h:8000/", "http://h:8000"),
        ("http://h:8000/v1", "http://h:8000"),
        ("https://h/v1/chat/completions", "https://h"),
        ("http://h:1/v1/completions", "http://h:1"),
    ],
)
def test_endpoint_urls_are_normalized(given: str, base: str) -> None:
    assert normalize_base_url(given) == base


def test_endpoint_without_scheme_is_refused() -> None:
    with pytest.raises(LoadgenError):
        normalize_base_url("localhost:8000")


def test_chat_payload_streams_with_usage_priority_and_ignore_eos() -> None:
    config = EndpointConfig("http://h", "m", api="chat", ignore_eos=True, extra_body={"temperature": 0})
    payload = build_payload(ScheduledRequest(0, 0.0, "hi there", 2, 16, -1), config)
    assert payload["messages"] == [{"role": "user", "content": "hi there"}]
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == payload["max_completion_tokens"] == 16
    assert (payload["ignore_eos"], payload["priority"], payload["temperature"]) == (True, -1, 0)
    assert config.url == "http://h/v1/chat/completions"


def test_completions_payload_without_priority_omits_the_field() -> None:
    config = EndpointConfig("http://h", "m", api="completions")
    payload = build_payload(ScheduledRequest(0, 0.0, [5, 6, 7], 3, 4, None), config)
    assert payload["prompt"] == [5, 6, 7]
    assert "priority" not in payload and "ignore_eos" not in payload and "messages" not in payload


async def test_sse_lines_split_only_on_line_feeds():
    from loadgen.client import sse_events, sse_lines

    async def chunks():
        for piece in (b'data: {"t": "a\xe2\x80\xa8b\xc2\x85c"}\r', b"\n\ndata: [DO", b"NE]\n\n"):
            yield piece

    events = [event async for event in sse_events(sse_lines(chunks()))]
    assert events == ['{"t": "a\u2028b\u0085c"}', "[DONE]"]
