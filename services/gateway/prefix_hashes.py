"""The prompt's block hashes for prefix-aware dispatch (`DispatchRequest.block_hashes`).

Hashed with the engines' own function (`shared.prefix_hash`, vLLM's sha256_cbor chain) at the
block size the live instances report, so the scheduler's prefix index can match them against
the blocks each instance holds. Off unless `--dispatch-prefix-hashes`: hashing costs a few
microseconds per block of gateway CPU, wasted while the scheduler dispatches by load only.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.messages import MAX_BLOCK_HASHES
from shared.prefix_hash import block_hashes


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int | None) -> tuple[list[int], int]:
    """(hashes, block size) for the dispatch request; ([], 0) when no instance reports a block
    size. At most MAX_BLOCK_HASHES: a longer prompt's tail is simply not matched."""
    if not block_size:
        return [], 0
    limit = min(len(prompt_token_ids), MAX_BLOCK_HASHES * block_size)
    return block_hashes(prompt_token_ids[:limit], block_size), block_size
