"""The KV data plane's wire format: what a source's sender and a destination's receiver exchange
over one TCP connection (pure: no sockets here; see `kv_sender` and `kv_receiver`).

A stage of a migration is shipped as one or more frames of at most `frame_bytes` of payload
(`frame_chunks`); the last stage's last frame (an empty one when it has no blocks) carries the
migration's COMMIT. Every integer is big-endian.

    frame   = header | payload | trailer [| commit | commit trailer]
    header  = magic "CKV4" | version u16 (4) | flags u16 | migration id 16 B (a UUID) |
              stage u32 | lease offset u32 | count u32 | payload length u64 |
              commit length u32 | header crc32 u32 (of everything before it)
    flags   = bit 0 TOKENS: a token frame (below); every other bit 0
    payload = the blocks' bytes in fused order (see `copier.BlockCopier`); a token frame's: the
              token slots' bytes in token-fused order (`BlockCopier.gather_tokens`)
    trailer = crc32 u32 of the payload
    commit  = (commit length > 0 only) the msgpack `MigrationCommit`, then its crc32 u32

    ack     = magic "CKA3" | status u16 (`AckStatus`) | detail length u16 (<= 1024) |
              migration id 16 B | stage u32 | lease offset u32 | detail (UTF-8, e.g. why a
              commit was refused)

The lease offset is the index, in the destination lease's reservation order, of the frame's first
block: source block i of the request lands in lease block i, so frames of a stage come in order.
A token frame counts token slots instead (offset and count): token position p of the request lands
in slot p % block_size of lease block p // block_size. It carries the slots of a block not yet
full, so the last stage sends only the tokens computed since the previous one, not whole blocks
(v3 had no token frames: its receivers would read one as blocks, so v3 is refused).

The receiver answers every frame with one ack, in frame order:
- a header that does not parse (bad magic, bad crc, another version such as v1/v2, a payload over
  the receiver's limit, a commit over MAX_COMMIT_BYTES) closes the connection: nothing after it
  can be trusted;
- a payload whose crc does not match is never counted as written: BAD_CHECKSUM, and the
  destination aborts that migration; a connection closed mid-frame aborts it too (TRUNCATED);
- a frame the destination cannot place is refused (UNKNOWN_MIGRATION, BAD_RANGE, BAD_SIZE) and
  its payload dropped; the connection goes on;
- a frame with a commit, once its payload is written, commits the migration through the same
  idempotent path as a NATS COMMIT: COMMITTED, or COMMIT_REFUSED with the reason in the detail (a
  frame that failed fails the migration, so its error status is the commit's refusal too).

The source takes the last frame's ack as the commit's answer: the downtime holds one TCP round
trip and no NATS hop. Only when that ack never comes (connection lost after the commit started
going out, timeout) is the outcome in doubt; the source then asks over NATS (the COMMIT is
idempotent; see `handshake.py`). One connection per destination is reused across stages and
migrations.

The checksum is CRC-32 (ISA-L's when the `isal` package is there: 15-25 GB/s from memory, 35-50
from cache, against zlib's ~4 GB/s on the 2-core CI machine; the same values). The sender knows a
payload's crc piece by piece, so it combines pieces' crcs (`crc32_combine`).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from services.llumlet.migration.protocol import migration_id_bytes, migration_id_from_bytes

MAGIC = b"CKV4"
ACK_MAGIC = b"CKA3"  # (unchanged since v3)
VERSION = 4
FLAG_TOKENS = 1
_HEADER = struct.Struct("!4sHH16sIIIQI")  # everything but the trailing header crc
HEADER_SIZE = _HEADER.size + 4
_CRC = struct.Struct("!I")  # the payload's and the commit's trailers
TRAILER_SIZE = _CRC.size
_ACK = struct.Struct("!4sHH16sII")
ACK_SIZE = _ACK.size
MAX_DETAIL_BYTES = 1024
MAX_COMMIT_BYTES = 4 << 20  # a commit section (the request's prompt and output ids) is far smaller


def pack_crc(crc: int) -> bytes:
    return _CRC.pack(crc)


def unpack_crc(raw: bytes | bytearray | memoryview, offset: int = 0) -> int:
    return _CRC.unpack_from(raw, offset)[0]


# -- CRC-32 ---------------------------------------------------------------------------------------

_CRC_POLY = 0xEDB88320  # reflected CRC-32


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (zlib's multmodp; `a` is never 0 here)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine: the CRC of A+B from crc(A), crc(B) and len(B) (the fallback
    without ISA-L; pure Python, ~10 µs)."""
    p, n, k = 1 << 31, len2, 3  # x^0; len2 bytes = 8 * len2 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


try:  # ISA-L's CRC-32 (same polynomial and values as zlib's, ~5-10x faster with PCLMUL)
    from isal.isal_zlib import crc32 as payload_crc32
    from isal.isal_zlib import crc32_combine
except ImportError:  # pragma: no cover - optional speed-up; both ends agree either way
    payload_crc32, crc32_combine = zlib.crc32, _crc32_combine


def crc32_of(views: Sequence[memoryview]) -> int:
    """CRC-32 of the views one after another."""
    crc = 0
    for view in views:
        crc = payload_crc32(view, crc)
    return crc


# -- header and ack -------------------------------------------------------------------------------


class FrameError(ValueError):
    """A header or ack that does not parse: the stream cannot be trusted past it."""


class AckStatus(enum.IntEnum):
    OK = 0
    BAD_CHECKSUM = 1
    UNKNOWN_MIGRATION = 2  # not (or no longer) running here: aborted, expired, committed
    BAD_RANGE = 3  # blocks outside the lease, or not the next ones
    BAD_SIZE = 4  # payload length does not match the number of blocks
    FAILED = 5  # the scatter (or the commit) itself failed
    TRUNCATED = 6  # never sent: the connection closed mid-frame
    COMMITTED = 7  # a commit frame: written, and the request runs here now (also: committed before)
    COMMIT_REFUSED = 8  # a commit frame: the commit was refused (the ack's detail says why)

    @property
    def is_error(self) -> bool:
        return self not in (AckStatus.OK, AckStatus.COMMITTED)


@dataclass(frozen=True)
class FrameHeader:
    migration_id: str
    stage: int
    lease_offset: int
    num_blocks: int
    payload_len: int
    payload_crc: int = 0  # carried by the trailer: known once the payload is in
    commit_len: int = 0  # bytes of the commit section after the trailer (0: no commit)
    tokens: bool = False  # a token frame: lease_offset and num_blocks count token slots

    def pack(self) -> bytes:
        flags = FLAG_TOKENS if self.tokens else 0
        head = _HEADER.pack(MAGIC, VERSION, flags, migration_id_bytes(self.migration_id), self.stage,
                            self.lease_offset, self.num_blocks, self.payload_len, self.commit_len)
        return head + zlib.crc32(head).to_bytes(4, "big")

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> FrameHeader:
        if len(raw) != HEADER_SIZE:
            raise FrameError(f"header of {len(raw)} bytes, expected {HEADER_SIZE}")
        head = bytes(raw[: _HEADER.size])
        magic, version = head[:4], int.from_bytes(head[4:6], "big")
        if magic[:3] == MAGIC[:3] and (magic != MAGIC or version != VERSION):  # v1-v3 (other layouts)
            raise FrameError(f"unsupported frame version {magic!r}/{version} (this receiver speaks {VERSION})")
        if zlib.crc32(head) != int.from_bytes(raw[_HEADER.size :], "big"):
            raise FrameError("header checksum mismatch")
        magic, version, flags, mid, stage, offset, num_blocks, length, commit_len = _HEADER.unpack(head)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        if flags & ~FLAG_TOKENS:
            raise FrameError(f"unknown frame flags {flags:#x}")
        return FrameHeader(migration_id_from_bytes(mid), stage, offset, num_blocks, length, commit_len=commit_len,
                           tokens=bool(flags & FLAG_TOKENS))


@dataclass(frozen=True)
class FrameAck:
    status: AckStatus
    migration_id: str
    stage: int
    lease_offset: int
    detail: str = ""  # why (a refused commit)

    def pack(self) -> bytes:
        detail = self.detail.encode("utf-8", "replace")[:MAX_DETAIL_BYTES]
        return _ACK.pack(ACK_MAGIC, self.status, len(detail), migration_id_bytes(self.migration_id), self.stage,
                         self.lease_offset) + detail

    @staticmethod
    def unpack_fixed(raw: bytes | bytearray | memoryview) -> tuple[FrameAck, int]:
        """The ack's fixed part, and how many detail bytes follow it."""
        magic, status, detail_len, mid, stage, offset = _ACK.unpack(bytes(raw))
        if magic != ACK_MAGIC:
            raise FrameError(f"bad ack magic {magic!r}")
        if detail_len > MAX_DETAIL_BYTES:
            raise FrameError(f"ack detail of {detail_len} bytes")
        try:
            return FrameAck(AckStatus(status), migration_id_from_bytes(mid), stage, offset), detail_len
        except ValueError as exc:
            raise FrameError(f"bad ack status {status}") from exc

    @staticmethod
    def unpack(raw: bytes | bytearray | memoryview) -> FrameAck:
        ack, detail_len = FrameAck.unpack_fixed(raw[:ACK_SIZE])
        if len(raw) != ACK_SIZE + detail_len:
            raise FrameError(f"ack of {len(raw)} bytes, expected {ACK_SIZE + detail_len}")
        return dataclasses.replace(ack, detail=bytes(raw[ACK_SIZE:]).decode("utf-8", "replace"))


# -- framing --------------------------------------------------------------------------------------


def frame_chunks(block_ids: Sequence[int], block_bytes: int, frame_bytes: int) -> list[list[int]]:
    """Split a stage's blocks into frames of at most `frame_bytes` (at least one block each; a
    stage without blocks is one empty frame, which may still carry the commit)."""
    if not block_ids:
        return [[]]
    per_frame = max(1, frame_bytes // block_bytes) if block_bytes else len(block_ids)
    return [list(block_ids[i : i + per_frame]) for i in range(0, len(block_ids), per_frame)]


def token_chunks(start: int, stop: int, token_bytes: int, frame_bytes: int) -> list[tuple[int, int]]:
    """Split token positions [start, stop) into token frames of at most `frame_bytes` (at least
    one slot each) as [start, stop) ranges."""
    per_frame = max(1, frame_bytes // token_bytes) if token_bytes else max(1, stop - start)
    return [(i, min(stop, i + per_frame)) for i in range(start, stop, per_frame)]


def commit_section(commit: bytes) -> bytes:
    """What follows a commit frame's payload trailer: the commit and its crc."""
    return commit + pack_crc(zlib.crc32(commit)) if commit else b""


def parse_address(address: str) -> tuple[str, int]:
    """A receiver's advertised "host:port" (IPv6 hosts in brackets)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad KV address {address!r} (expected host:port)")
    return host.strip("[]"), int(port)
