"""Chained prefix-block hashes: one function for the gateway, the engines and the simulator.

A prompt is cut into blocks of `block_size` tokens; only full blocks get a hash. Each block's hash
covers its parent's hash and its own tokens, so one hash names the whole prefix up to and
including that block (vLLM's `hash_block_tokens`, Mooncake's `hash_ids`): two prompts share a
block hash exactly when they share every token up to the end of that block.

The hash is SHA-256 over a fixed little-endian encoding, truncated to 63 bits so it travels as a
non-negative int64 on the wire. It is stable across processes and machines (unlike Python's
`hash`), so a gateway and an engine compute the same chain independently. It is NOT vLLM's own
hash (vLLM hashes a pickled/CBOR tuple with a per-process random or configured seed, see the
module notes in docs): a scheduler fed by vLLM's KV events needs the llumlet to translate.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable, Sequence

ROOT_HASH = 0  # parent of the first block
HASH_BITS = 63
_MASK = (1 << HASH_BITS) - 1
_TOKENS_TAG = b"T"
_TRACE_TAG = b"M"  # a trace block (Mooncake hash_id), never equal to a token block's encoding


def chain_hash(parent: int, content: bytes) -> int:
    """The hash of one block: its parent's hash and its content (already encoded)."""
    digest = hashlib.sha256(struct.pack("<Q", parent) + content).digest()
    return int.from_bytes(digest[:8], "little") & _MASK


def _token_content(tokens: Sequence[int]) -> bytes:
    return _TOKENS_TAG + array("I", tokens).tobytes()  # token ids are < 2**32 (bounded on the wire)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chained hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, _token_content(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


def trace_block_hashes(hash_ids: Iterable[int], trace_block_tokens: int, num_tokens: int, block_size: int) -> list[int]:
    """The chain a prompt described by a trace's `hash_ids` would have: trace block k (of
    `trace_block_tokens` tokens, named by hash_ids[k]) stands for tokens that are a function of
    that id, so each of its `block_size` sub-blocks hashes (parent, id, position in the block).
    Only sub-blocks that are full and covered by `num_tokens` get a hash; tokens past the last
    id are unique to the request (no hash)."""
    if block_size < 1 or trace_block_tokens < 1 or trace_block_tokens % block_size:
        raise ValueError(f"block_size {block_size} must divide the trace's block of {trace_block_tokens} tokens")
    hashes: list[int] = []
    parent = ROOT_HASH
    full_blocks = num_tokens // block_size
    for hash_id in hash_ids:
        for offset in range(0, trace_block_tokens - block_size + 1, block_size):
            if len(hashes) >= full_blocks:
                return hashes
            parent = chain_hash(parent, _TRACE_TAG + struct.pack("<qI", hash_id, offset))
            hashes.append(parent)
    return hashes
