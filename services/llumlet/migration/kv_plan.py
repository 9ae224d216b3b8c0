"""What one migration stage sends, in frame order (pure: the source decides it, `kv_sender` ships
it): whole blocks, and where the KV layout has token slots (`BlockCopier.token_bytes`), the
computed slots of a block not yet full as token frames (`kv_wire`), so no slot is sent twice and
the last stage carries only the tokens computed since the stage before."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenRun:
    """Token positions [start, stop) of a request whose blocks are `table` (request order), sent
    as token frames: the slots of a block not yet full (or the rest of one begun)."""

    table: Sequence[int]
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


Chunk = list[int] | tuple[TokenRun, tuple[int, int]]  # one frame: block ids, or a run's [start, stop)


@dataclass(frozen=True)
class StagePlan:
    """What one stage sends, in frame order: the rest of a block begun by token (`head`), whole
    blocks (lease blocks from `first_block` on), the slots of a block not yet full (`tail`)."""

    head: TokenRun | None
    first_block: int
    block_ids: Sequence[int]
    tail: TokenRun | None

    @property
    def num_tokens(self) -> int:
        """Slots sent by token."""
        return sum(run.num_tokens for run in (self.head, self.tail) if run is not None)

    @property
    def is_empty(self) -> bool:
        return not self.block_ids and not self.num_tokens


def plan_tokens(table: Sequence[int], sent: int, stop: int, block_size: int) -> StagePlan:
    """A stage that sends token positions [sent, stop) of a request whose blocks are `table`:
    the rest of a block begun by token, whole blocks, then the slots of the block `stop` falls in.
    With no whole block among them, one token frame for all (a last stage: one frame, one ack)."""
    assert 0 <= sent <= stop <= len(table) * block_size, (sent, stop, len(table))
    if -(-sent // block_size) >= stop // block_size:  # no block wholly inside
        return StagePlan(None, sent // block_size, [], TokenRun(table, sent, stop))
    pos, head = sent, None
    if pos % block_size:
        head = TokenRun(table, pos, min(stop, (pos // block_size + 1) * block_size))
        pos = head.stop
    first = pos // block_size
    whole = max(first, stop // block_size)
    return StagePlan(head, first, table[first:whole], TokenRun(table, max(pos, whole * block_size), stop))
