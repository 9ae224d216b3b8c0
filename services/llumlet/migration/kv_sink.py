"""What the KV receiver hands frames to: the destination's side of a frame (the incoming-migration
registry, `destination.py` over `leases.py`, implements it; tests implement it over a plain pool)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.llumlet.migration.kv_wire import AckStatus, FrameHeader


class FrameSink(Protocol):
    """The destination's side of a frame (implemented by the incoming-migration registry)."""

    def admit(self, header: FrameHeader) -> AckStatus:
        """May this frame be written now? (migration running, next blocks of its lease, size)"""

    async def write(self, header: FrameHeader, payload: memoryview) -> AckStatus:
        """Scatter the (checksum-verified) payload into the lease's blocks."""

    def frame_failed(self, header: FrameHeader, status: AckStatus) -> None:
        """A frame of this migration was refused, corrupt or truncated: abort it."""

    async def commit_frame(self, header: FrameHeader, commit: bytes, frame_status: AckStatus) -> tuple[AckStatus, str]:
        """The frame that carried `commit` (msgpack `MigrationCommit`, checksum verified) ended
        with `frame_status` (its failure, if any, was reported already). Commit if it may, the
        way a NATS COMMIT does; the answer (COMMITTED, or an error status and why) is its ack."""


class DirectFrameSink(FrameSink, Protocol):
    """A sink that can lend its blocks, so that the payload is received straight into them (no
    staging buffer, no scatter). Used when the sink has these methods."""

    def open_frame(self, header: FrameHeader) -> Sequence[memoryview] | AckStatus | None:
        """Admit the frame and lend writable views of its target blocks in fused order (see
        `BlockCopier.block_views`), pinned until `close_frame`; an AckStatus refuses it; None
        takes the staged path (`write`) for this frame."""

    def close_frame(self, header: FrameHeader, ok: bool) -> AckStatus:
        """The lent views are no longer written: unpin them. `ok`: the whole payload arrived and
        its checksum matched, so the blocks count as written; otherwise they hold garbage."""
