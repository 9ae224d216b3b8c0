"""Typed refusals and scaling actions on the wire: they round-trip, an older peer's message without
a reason still decodes, and a value nobody defined is a WireError at the edge."""

from __future__ import annotations

import msgspec
import pytest

from services.gateway.errors import REFUSAL_STATUS
from shared.messages import Ack, DispatchReply, Refusal, ScalingAction, ScalingEvent, WireError, decode, encode


@pytest.mark.parametrize("reason", list(Refusal))
def test_refusals_round_trip_and_each_has_an_http_status(reason):
    assert decode(encode(Ack(ok=False, error="words", reason=reason)), Ack).reason is reason
    assert decode(encode(DispatchReply(rejected="words", reason=reason)), DispatchReply).reason is reason
    assert 400 <= REFUSAL_STATUS[reason] < 600


def test_a_message_from_a_peer_without_reasons_still_decodes():
    class OldAck(msgspec.Struct, omit_defaults=True):
        ok: bool
        error: str | None = None

    assert decode(msgspec.msgpack.encode(OldAck(False, "refused")), Ack) == Ack(ok=False, error="refused")


def test_an_undefined_reason_or_action_is_a_wire_error():
    with pytest.raises(WireError):
        decode(msgspec.msgpack.encode({"ok": False, "reason": "tired"}), Ack)
    with pytest.raises(WireError):
        decode(msgspec.msgpack.encode({"action": "explode", "instance_id": "a", "instances": 1, "at": 0.0}),
               ScalingEvent)


def test_scaling_actions_are_typed_and_read_as_their_old_strings():
    event = decode(encode(ScalingEvent(ScalingAction.SCALE_OUT, "a", 2, 1.0)), ScalingEvent)
    assert event.action is ScalingAction.SCALE_OUT and event.action == "scale_out"
