"""The KV data plane's wire format (`kv_wire`), pure: header, ack, CRC, framing. Frames and acks
are also built by hand from the layout the module doc states, so the doc stays the spec."""

from __future__ import annotations

import struct
import uuid
import zlib

import numpy as np
import pytest

from services.llumlet.migration import kv_wire
from services.llumlet.migration.kv_wire import (
    HEADER_SIZE,
    AckStatus,
    FrameAck,
    FrameError,
    FrameHeader,
    commit_section,
    frame_chunks,
    parse_address,
)
from services.llumlet.migration.protocol import new_migration_id


def test_header_round_trip() -> None:
    header = FrameHeader(new_migration_id(), stage=3, lease_offset=17, num_blocks=5, payload_len=5 * 256)
    raw = header.pack()
    assert len(raw) == HEADER_SIZE
    assert FrameHeader.unpack(raw) == header


def test_header_made_by_the_documented_layout_parses() -> None:
    """magic "CKV4" | version u16 | flags u16 | id 16 B | stage u32 | lease offset u32 |
    count u32 | payload length u64 | commit length u32 | header crc32 u32, big-endian; flag bit 0:
    a token frame."""
    mid = uuid.uuid4()
    for flags, tokens in ((0, False), (1, True)):
        head = (b"CKV4" + (4).to_bytes(2, "big") + flags.to_bytes(2, "big") + mid.bytes + (4).to_bytes(4, "big")
                + (9).to_bytes(4, "big") + (2).to_bytes(4, "big") + (512).to_bytes(8, "big")
                + (77).to_bytes(4, "big"))
        raw = head + zlib.crc32(head).to_bytes(4, "big")
        assert len(raw) == HEADER_SIZE
        assert FrameHeader.unpack(raw) == FrameHeader(mid.hex, 4, 9, 2, 512, commit_len=77, tokens=tokens)
        assert FrameHeader(mid.hex, 4, 9, 2, 512, commit_len=77, tokens=tokens).pack() == raw


def test_unknown_flags_and_v3_headers_are_refused() -> None:
    """A v3 receiver had no token frames; a v4 one refuses v3 frames and flags it does not know."""
    mid = uuid.uuid4()
    for magic, version, flags in ((b"CKV3", 3, 0), (b"CKV4", 4, 2)):
        head = (magic + version.to_bytes(2, "big") + flags.to_bytes(2, "big") + mid.bytes + bytes(24))
        with pytest.raises(FrameError):
            FrameHeader.unpack(head + zlib.crc32(head).to_bytes(4, "big"))


def test_ack_made_by_the_documented_layout_parses() -> None:
    """magic "CKA3" | status u16 | detail length u16 | id 16 B | stage u32 | lease offset u32 | detail."""
    mid = uuid.uuid4()
    detail = "no room".encode()
    raw = (b"CKA3" + AckStatus.COMMIT_REFUSED.to_bytes(2, "big") + len(detail).to_bytes(2, "big") + mid.bytes
           + (5).to_bytes(4, "big") + (40).to_bytes(4, "big") + detail)
    assert FrameAck.unpack(raw) == FrameAck(AckStatus.COMMIT_REFUSED, mid.hex, 5, 40, "no room")


def test_ack_round_trip() -> None:
    ack = FrameAck(AckStatus.BAD_CHECKSUM, new_migration_id(), 2, 40)
    assert FrameAck.unpack(ack.pack()) == ack


def test_ack_carries_a_detail() -> None:
    ack = FrameAck(AckStatus.COMMIT_REFUSED, new_migration_id(), 2, 40, "KV incomplete: 3 of 4 blocks written")
    assert FrameAck.unpack(ack.pack()) == ack
    with pytest.raises(FrameError):
        FrameAck.unpack(ack.pack()[:-2])


def test_an_ack_of_unknown_status_or_magic_is_a_frame_error() -> None:
    good = bytearray(FrameAck(AckStatus.OK, new_migration_id(), 0, 0).pack())
    bad_status, bad_magic = bytearray(good), bytearray(good)
    bad_status[4:6] = (99).to_bytes(2, "big")
    bad_magic[0:4] = b"NOPE"
    for raw in (bad_status, bad_magic):
        with pytest.raises(FrameError):
            FrameAck.unpack(raw)


def test_only_ok_and_committed_are_not_errors() -> None:
    assert {status for status in AckStatus if not status.is_error} == {AckStatus.OK, AckStatus.COMMITTED}


@pytest.mark.parametrize("position", [0, 5, 30, HEADER_SIZE - 1])
def test_corrupt_header_is_rejected(position: int) -> None:
    raw = bytearray(FrameHeader(new_migration_id(), 0, 0, 1, 256, 1).pack())
    raw[position] ^= 0x01
    with pytest.raises(FrameError):
        FrameHeader.unpack(raw)


def test_truncated_header_is_rejected() -> None:
    with pytest.raises(FrameError):
        FrameHeader.unpack(FrameHeader(new_migration_id(), 0, 0, 1, 256, 1).pack()[:-3])


def test_a_frame_of_another_version_is_refused_by_name() -> None:
    mid = new_migration_id()
    v2_layout = struct.Struct("!4sHH16sIIIQ")  # the previous version: no commit length
    head = v2_layout.pack(b"CKV2", 2, 0, uuid.UUID(hex=mid).bytes, 0, 0, 1, 256)
    v2_header = head + zlib.crc32(head).to_bytes(4, "big") + b"\x00" * (HEADER_SIZE - len(head) - 4)
    with pytest.raises(FrameError, match="unsupported frame version"):
        FrameHeader.unpack(v2_header)


def test_frames_split_a_stage_by_size() -> None:
    assert frame_chunks(list(range(10)), 100, 350) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert frame_chunks(list(range(3)), 100, 10) == [[0], [1], [2]]  # at least one block per frame
    assert frame_chunks([], 100, 350) == [[]]  # one empty frame: it can still carry the commit
    assert frame_chunks([4, 5], 0, 350) == [[4, 5]]  # no KV bytes: one empty frame


def test_the_commit_section_is_the_commit_and_its_crc() -> None:
    assert commit_section(b"") == b""
    assert commit_section(b"commit") == b"commit" + zlib.crc32(b"commit").to_bytes(4, "big")


def test_bad_address_is_a_clear_error() -> None:
    assert parse_address("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_address("[::1]:5000") == ("::1", 5000)
    for bad in ("nohost", ":5000", "host:", "host:port"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_crc_combine_fallback_matches_zlib() -> None:
    rng = np.random.default_rng(5)
    a, b = rng.bytes(1000), rng.bytes(70_001)
    assert kv_wire._crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert kv_wire._crc32_combine(0, zlib.crc32(b), len(b)) == zlib.crc32(b)  # after nothing
    assert kv_wire.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc_of_views_is_the_crc_of_their_bytes() -> None:
    views = [memoryview(b"abc"), memoryview(b""), memoryview(bytes(range(200)))]
    assert kv_wire.crc32_of(views) == zlib.crc32(b"abc" + bytes(range(200)))
