"""Chained prefix-block hashes: one function for the gateway, the engines and the simulator,
and the same hashes vLLM computes with `--prefix-caching-hash-algo sha256_cbor`.

A prompt is cut into blocks of `block_size` tokens; only full blocks get a hash. Each block's hash
covers its parent's hash and its own tokens, so one hash names the whole prefix up to and
including that block: two prompts share a block hash exactly when they share every token up to
the end of that block.

The digest is vLLM v1's `hash_block_tokens(sha256_cbor, parent, tokens, extra_keys=None)`:
SHA-256 of the canonical CBOR of (parent digest, token tuple, None), the first parent being
SHA-256 of the CBOR of "vllm-none-hash" (vLLM's seed for cryptographic hashes when
PYTHONHASHSEED is unset). CBOR is written here by hand (four item kinds), so no engine code is
needed to hash. On the wire a block hash is the digest's last 8 bytes, big-endian, top bit
cleared: vLLM's integer KV-event hash (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) `& (2**63 - 1)`.
Requests with vLLM extra keys (LoRA, multimodal inputs, cache_salt) hash differently there.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

HASH_BITS = 63
_MASK = (1 << HASH_BITS) - 1
VLLM_NONE_HASH_SEED = "vllm-none-hash"


def _cbor_head(major: int, value: int) -> bytes:
    """A canonical (shortest) CBOR item head."""
    if value < 24:
        return bytes((major << 5 | value,))
    if value < 1 << 8:
        return bytes((major << 5 | 24, value))
    if value < 1 << 16:
        return bytes((major << 5 | 25,)) + struct.pack(">H", value)
    if value < 1 << 32:
        return bytes((major << 5 | 26,)) + struct.pack(">I", value)
    return bytes((major << 5 | 27,)) + struct.pack(">Q", value)


def _cbor_uints(values: Sequence[int]) -> bytes:
    return _cbor_head(4, len(values)) + b"".join(_cbor_head(0, v) for v in values)


ROOT_DIGEST = hashlib.sha256(_cbor_head(3, len(VLLM_NONE_HASH_SEED)) + VLLM_NONE_HASH_SEED.encode()).digest()
_CBOR_NONE = b"\xf6"


def chain_digest(parent: bytes, tokens: Sequence[int], extra: Sequence[int] | None = None) -> bytes:
    """One block's digest: SHA-256 of CBOR [parent, tokens, extra or null]."""
    body = _cbor_head(2, len(parent)) + parent + _cbor_uints(tokens)
    body += _CBOR_NONE if extra is None else _cbor_uints(extra)
    return hashlib.sha256(b"\x83" + body).digest()


def wire_hash(digest: bytes) -> int:
    """The 63-bit form a digest travels in (and vLLM's integer KV-event hash, top bit cleared)."""
    return int.from_bytes(digest[-8:], "big") & _MASK


def block_digests(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_DIGEST) -> list[bytes]:
    """The chained digests of the full blocks of `token_ids` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    digests: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_digest(parent, token_ids[start:start + block_size])
        digests.append(parent)
    return digests


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_DIGEST) -> list[int]:
    """The wire hashes of the full blocks of `token_ids`: what the gateway sends for a prompt."""
    return [wire_hash(d) for d in block_digests(token_ids, block_size, parent)]


def trace_block_hashes(hash_ids: Iterable[int], trace_block_tokens: int, num_tokens: int, block_size: int) -> list[int]:
    """The chain a prompt described by a trace's `hash_ids` would have: trace block k (of
    `trace_block_tokens` tokens, named by hash_ids[k]) stands for tokens that are a function of
    that id, so each of its `block_size` sub-blocks hashes (parent, no tokens, [id, offset]) —
    never equal to a real token block, which has tokens. Only sub-blocks that are full and covered
    by `num_tokens` get a hash; tokens past the last id are unique to the request (no hash)."""
    if block_size < 1 or trace_block_tokens < 1 or trace_block_tokens % block_size:
        raise ValueError(f"block_size {block_size} must divide the trace's block of {trace_block_tokens} tokens")
    hashes: list[int] = []
    parent = ROOT_DIGEST
    full_blocks = num_tokens // block_size
    for hash_id in hash_ids:
        if hash_id < 0:
            raise ValueError(f"trace hash ids are non-negative, not {hash_id}")
        for offset in range(0, trace_block_tokens, block_size):
            if len(hashes) >= full_blocks:
                return hashes
            parent = chain_digest(parent, (), (hash_id, offset))
            hashes.append(wire_hash(parent))
    return hashes
