"""The one chained block-hash function (shared.prefix_hash) and the trace chains built with it."""

from __future__ import annotations

import pytest

from shared.prefix_hash import (
    HASH_BITS,
    ROOT_DIGEST,
    block_digests,
    block_hashes,
    chain_digest,
    trace_block_hashes,
    wire_hash,
)


def test_only_full_blocks_are_hashed_and_each_hash_names_the_whole_prefix():
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == wire_hash(chain_digest(ROOT_DIGEST, tokens[:4]))
    assert block_hashes(tokens[:8] + [99], 4) == hashes  # the partial block changes nothing
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == hashes[0]
    assert block_hashes([7, 1, 2, 3, 4, 5, 6, 7], 4)[1] != hashes[1]  # same block, other parent
    assert all(0 <= h < 1 << HASH_BITS for h in hashes)


def test_a_chain_continues_from_its_parent():
    tokens = list(range(1000, 1032))
    whole = block_digests(tokens, 8)
    assert block_digests(tokens[16:], 8, parent=whole[1]) == whole[2:]


def test_trace_chains_share_exactly_the_shared_hash_ids():
    a = trace_block_hashes([1, 2, 3], 512, 3 * 512, 16)
    b = trace_block_hashes([1, 2, 4], 512, 3 * 512, 16)
    assert len(a) == len(b) == 96
    assert a[:64] == b[:64] and not set(a[64:]) & set(b[64:])
    assert trace_block_hashes([1, 2, 3], 512, 700, 16) == a[:700 // 16]  # full blocks of the prompt only
    assert trace_block_hashes([1], 512, 4000, 16) == a[:32]  # tokens past the ids are unique
    assert not set(a) & set(block_hashes(list(range(512)), 16))  # trace blocks never equal token blocks


def test_the_hashes_are_vllms_sha256_cbor_block_hashes():
    """vLLM's own function, seeded as an engine seeds it without PYTHONHASHSEED, on token ids
    of every CBOR width: the digests are equal, and the wire hash is its KV-event int hash."""
    import os

    if "PYTHONHASHSEED" in os.environ:
        pytest.skip("vLLM derives its root hash from PYTHONHASHSEED when set")
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256_cbor

    kv_cache_utils.init_none_hash(sha256_cbor)
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 151_000, 2**31 - 1, 5, 6, 7, 8, 9, 10, 11] * 3
    parent, theirs = None, []
    for start in range(0, 48, 16):
        parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start:start + 16], None)
        theirs.append(bytes(parent))
    assert block_digests(tokens, 16) == theirs
    assert block_hashes(tokens, 16) == [int.from_bytes(d, "big") % 2**64 & (2**63 - 1) for d in theirs]


def test_block_size_must_divide_the_trace_block():
    with pytest.raises(ValueError):
        trace_block_hashes([1], 512, 512, 48)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_dispatch_request_carries_bounded_block_hashes():
    import msgspec

    from shared.messages import MAX_BLOCK_HASHES, DispatchRequest, WireError, decode, encode

    hashes = block_hashes(list(range(64)), 16)
    message = DispatchRequest("r1", 64, 8, block_hashes=hashes, prefix_block_size=16)
    assert decode(encode(message), DispatchRequest) == message
    assert decode(encode(DispatchRequest("r2", 64, 8)), DispatchRequest).block_hashes == []
    for bad in ([-1], [1 << 63], [0] * (MAX_BLOCK_HASHES + 1)):
        raw = msgspec.msgpack.encode({"request_id": "r", "num_prompt_tokens": 1, "max_tokens": 1, "block_hashes": bad})
        with pytest.raises(WireError):
            decode(raw, DispatchRequest)
