"""The wire format's base: the error a bad payload raises, the bounded field types, the
struct base, finish and refusal reasons, and `encode`/`decode`, the only way in and out."""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from shared import bus_guard

__all__ = [
    "WireError",
    "MAX_PAYLOAD_BYTES",
    "MAX_LIST",
    "InstanceId",
    "RequestId",
    "Subject",
    "Count",
    "TokenId",
    "TokenIds",
    "Seconds",
    "FinishReason",
    "Refusal",
    "Struct",
    "encode",
    "decode",
    "decode_or_drop",
    "decode_own_or_drop",
]


T = TypeVar("T")


class WireError(ValueError):
    """A payload that does not decode into the expected message type. `reason` (a metric label):
    malformed (not MessagePack), invalid (wrong schema or a value out of bounds), oversized, nested."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


# Constraints checked on decode (never on construction: a service's own messages are trusted).
# Everything a peer sends is bounded here, once, so no handler divides by a zero block size,
# publishes to a subject with a space in it or allocates for a billion-entry list.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # NATS' own limit is 1 MiB unless raised; a frame cap regardless


MAX_LIST = 1 << 20  # tokens of one request (context lengths stay far below)


# `\Z`, not `$`: a pattern is searched, and `$` matches before a trailing newline too.
InstanceId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_\-]+\Z", max_length=128)]  # = subjects.valid_token


RequestId = Annotated[str, Meta(min_length=1, max_length=256)]


# A NATS subject one may publish to: dot-separated non-empty tokens, no whitespace, no wildcard.
Subject = Annotated[str, Meta(pattern=r"^[^\s.*>]+(\.[^\s.*>]+)*\Z", max_length=256)]


Count = Annotated[int, Meta(ge=0, le=2**53)]


TokenId = Annotated[int, Meta(ge=0, lt=2**31)]


TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_LIST)]


Seconds = Annotated[float, Meta(ge=0.0, le=1e12)]  # a duration or a wall-clock time: finite, not negative


def _no_nan(**values: float) -> None:
    """Called from `__post_init__`, which runs on decode too (msgspec turns the error into a
    ValidationError): NaN compares false with everything, so it would slip through every policy."""
    for name, value in values.items():
        if value is not None and math.isnan(value):
            raise ValueError(f"{name} is NaN")


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Refusal(str, enum.Enum):
    """Why a request was not taken. The gateway maps each to an HTTP status and a metric label, so
    no one reads meaning out of the accompanying message text."""

    TOO_LONG = "too_long"  # the prompt (with its output budget) does not fit the context: 400
    INVALID = "invalid"  # a malformed or out-of-range request (bad token id, bad sampling): 400
    DUPLICATE = "duplicate"  # the request id is already running there: 409
    DRAINING = "draining"  # the instance is leaving; another may take the request: 503
    OVERLOADED = "overloaded"  # early rejection, every instance too loaded: 429, retry later
    NO_INSTANCE = "no_instance"  # no live instance at all: 503
    ENGINE_FAILED = "engine_failed"  # the instance's engine is not running: 503


class Struct(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Base for wire structs; unknown fields are ignored so old and new services interoperate."""


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T]) -> T:
    if len(data) > MAX_PAYLOAD_BYTES:
        raise WireError(f"bad {type_.__name__} payload: {len(data)} bytes (at most {MAX_PAYLOAD_BYTES})",
                        "oversized")
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise WireError(f"bad {type_.__name__} payload: {exc}", "invalid") from exc
    except msgspec.DecodeError as exc:
        raise WireError(f"bad {type_.__name__} payload: {exc}", "malformed") from exc
    except RecursionError as exc:  # nesting deeper than the interpreter's stack, from any peer
        raise WireError(f"bad {type_.__name__} payload: nested too deeply", "nested") from exc


def decode_or_drop(data: bytes, type_: type[T], log: logging.Logger, what: str, subject: str = "") -> T | None:
    """For fire-and-forget subjects: a bad payload is counted (`shared.bus_guard`), logged
    (rate-limited) and dropped, never raised into a subscription callback."""
    try:
        return decode(data, type_)
    except WireError as exc:
        bus_guard.rejected(subject, exc.reason, str(exc), log, what)
        return None


def decode_own_or_drop(data: bytes, type_: type[T], log: logging.Logger, what: str, subject: str,
                       own_subject: Callable[[T], str]) -> T | None:
    """`decode_or_drop` for a message about one instance, which must come on that instance's
    own subject (`own_subject(message)`): an instance speaks for itself only, and an id the
    subject does not carry is one no subject can be built for (dropped as `wrong_subject`)."""
    message = decode_or_drop(data, type_, log, what, subject)
    if message is not None and own_subject(message) != subject:
        bus_guard.rejected(subject, "wrong_subject", f"about another instance: {message!r}"[:300], log, what)
        return None
    return message


_encoder = msgspec.msgpack.Encoder()
