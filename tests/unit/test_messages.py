"""Wire messages: round trip, validation at the edge, drop-and-log for fire-and-forget subjects."""

from __future__ import annotations

import logging

import pytest

from shared import bus_guard, subjects
from shared.messages import AbortRequest, TokenChunk, WireError, decode, decode_load_report, decode_or_drop, encode
from tests.unit.policy_helpers import make_load


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


@pytest.mark.parametrize("instance_id", ["i\n", "i\r", "i\n\n", "\ni", "i.j", "i j", ""])
def test_an_instance_id_no_subject_can_carry_is_refused_everywhere(instance_id):
    # "i\n" passed both checks when they ended in `$`, which matches before a trailing newline
    with pytest.raises(WireError):
        decode(encode(TokenChunk(request_id="r", instance_id=instance_id, start_index=0, token_ids=[1])), TokenChunk)
    with pytest.raises(ValueError):
        subjects.llumlet(instance_id, "generate")


def test_a_load_report_is_taken_only_from_its_own_instances_subject():
    log = logging.getLogger("test")
    data = encode(make_load("a"))
    assert decode_load_report(data, log, subjects.load_report("a")).instance_id == "a"
    before = bus_guard.rejected_count("corral.load.*", "wrong_subject")
    assert decode_load_report(data, log, subjects.load_report("b")) is None
    assert bus_guard.rejected_count("corral.load.*", "wrong_subject") == before + 1


def test_a_metric_label_names_only_a_verb_that_is_a_whole_token():
    assert subjects.pattern_of(subjects.llumlet("i", "generate")) == "corral.llumlet.*.generate"
    assert subjects.pattern_of("corral.llumlet.i.gen erate") == "other"  # (any label would be a new series)
    assert subjects.pattern_of("corral.llumlet.i.generate\n") == "other"
