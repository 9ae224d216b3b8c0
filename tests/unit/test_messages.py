"""Wire messages: round trip, validation at the edge, drop-and-log for fire-and-forget subjects."""

from __future__ import annotations

import logging

import pytest

from shared.messages import AbortRequest, TokenChunk, WireError, decode, decode_or_drop, encode


def test_round_trip():
    chunk = TokenChunk(request_id="r", instance_id="i", start_index=3, token_ids=[1, 2])
    assert decode(encode(chunk), TokenChunk) == chunk


def test_wrong_type_is_a_wire_error():
    with pytest.raises(WireError):
        decode(encode(AbortRequest(request_id="r")), TokenChunk)


def test_decode_or_drop_logs_and_returns_none(caplog):
    log = logging.getLogger("test")
    with caplog.at_level(logging.WARNING):
        assert decode_or_drop(b"\xc1 not msgpack", TokenChunk, log, "token chunk") is None
    assert "dropping a bad token chunk" in caplog.text
    assert decode_or_drop(encode(AbortRequest(request_id="r")), AbortRequest, log, "abort").request_id == "r"
