"""The prompt's block hashes for prefix-aware dispatch (`DispatchRequest.block_hashes`).

Hashed with the engines' own function (`shared.prefix_hash`, vLLM's sha256_cbor chain) at the
block size the live instances report, so the scheduler's prefix index can match them against
the blocks each instance holds. Off unless `--dispatch-prefix-hashes`: hashing costs a few
microseconds per block of gateway CPU, wasted while the scheduler dispatches by load only.

Hashing holds the GIL (hashlib releases it only for inputs far larger than a block's), so it
runs on the event loop in turns of `BLOCKS_PER_TURN` blocks, each ~1 ms: a 128k-token prompt's
~45 ms never delays another client by more than a turn (issue 15). The `n` choices of one
request share its prompt list and are hashed once (`PromptHasher` remembers the last few).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from shared.messages import MAX_BLOCK_HASHES
from shared.prefix_hash import ROOT_DIGEST, block_digests, wire_hash

BLOCKS_PER_TURN = 160  # ~5.4 µs a block: under a millisecond of the loop at a time
REMEMBERED_PROMPTS = 8


async def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int | None) -> tuple[list[int], int]:
    """(hashes, block size) for the dispatch request; ([], 0) when no instance reports a block
    size. At most MAX_BLOCK_HASHES: a longer prompt's tail is simply not matched."""
    if not block_size:
        return [], 0
    end = min(len(prompt_token_ids) // block_size, MAX_BLOCK_HASHES) * block_size  # full blocks only
    turn = BLOCKS_PER_TURN * block_size
    hashes: list[int] = []
    parent = ROOT_DIGEST
    for start in range(0, end, turn):
        if start:
            await asyncio.sleep(0)  # let the other clients' work run between turns
        digests = block_digests(prompt_token_ids[start:min(start + turn, end)], block_size, parent)
        parent = digests[-1]
        hashes.extend(wire_hash(digest) for digest in digests)
    return hashes, block_size


class PromptHasher:
    """`prompt_block_hashes`, remembering the last few prompts by identity: a request's choices
    (and a choice placed again) carry the same list. Each remembered entry holds its list, so
    its id cannot be reused by another while remembered; a resumed request's longer prompt is
    a new list, hashed anew."""

    def __init__(self, remembered: int = REMEMBERED_PROMPTS) -> None:
        self._remembered = remembered
        self._recent: OrderedDict[tuple[int, int], tuple[Sequence[int], list[int]]] = OrderedDict()

    async def hashes(self, prompt_token_ids: Sequence[int], block_size: int | None) -> tuple[list[int], int]:
        if not block_size:
            return [], 0
        key = (id(prompt_token_ids), block_size)
        entry = self._recent.get(key)
        if entry is not None and entry[0] is prompt_token_ids:
            self._recent.move_to_end(key)
            return entry[1], block_size
        hashes, _ = await prompt_block_hashes(prompt_token_ids, block_size)
        self._recent[key] = (prompt_token_ids, hashes)
        while len(self._recent) > self._remembered:
            self._recent.popitem(last=False)
        return hashes, block_size
