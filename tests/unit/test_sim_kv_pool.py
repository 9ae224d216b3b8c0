from __future__ import annotations

import numpy as np
import pytest

from shared.engine_model.kv_pool import KVPool, request_key


def filled_pool(blocks: list[int], num_tokens: int, rid: str = "req") -> tuple[KVPool, int]:
    pool = KVPool(num_blocks=16, block_size=4, kv_bytes_per_token=16)
    key = request_key(rid)
    pool.write_tokens(key, blocks, 0, 5)  # written in two steps, like a prefill then decodes
    pool.write_tokens(key, blocks, 5, num_tokens)
    return pool, key


def test_written_tokens_verify() -> None:
    pool, key = filled_pool([7, 2, 11], 10)
    assert pool.verify(key, [7, 2, 11], 10)
    assert not pool.verify(request_key("other"), [7, 2, 11], 10)
    assert not pool.verify(key, [2, 7, 11], 10)  # block order matters
    assert not pool.verify(key, [7, 2, 11], 13)  # positions 10..12 were never written


def test_gather_scatter_round_trip_moves_a_request_between_pools() -> None:
    src, key = filled_pool([7, 2, 11], 10)
    fused = src.gather([7, 2, 11])
    assert fused.shape == (3, src.block_bytes) and fused.flags.c_contiguous
    dst = KVPool(num_blocks=16, block_size=4, kv_bytes_per_token=16)
    dst.scatter([0, 15, 3], fused.tobytes())  # bytes as they come off the wire
    assert dst.verify(key, [0, 15, 3], 10)


def test_gather_into_a_reused_buffer() -> None:
    pool, _ = filled_pool([1, 2, 3], 12)
    staging = np.empty((2, pool.block_bytes), dtype=np.uint8)
    result = pool.gather([3, 1], out=staging)
    assert result is staging
    assert np.array_equal(staging, pool.data[[3, 1]])
    with pytest.raises(ValueError):
        pool.gather([1, 2, 3], out=staging)


def test_verify_detects_a_corrupted_byte() -> None:
    src, key = filled_pool([4, 5, 6], 11)
    fused = src.gather([4, 5, 6])
    fused[1, 7] ^= 0x01
    dst = KVPool(num_blocks=16, block_size=4, kv_bytes_per_token=16)
    dst.scatter([4, 5, 6], fused)
    assert not dst.verify(key, [4, 5, 6], 11)


def test_scatter_rejects_a_buffer_of_the_wrong_size() -> None:
    pool = KVPool(num_blocks=4, block_size=4, kv_bytes_per_token=8)
    with pytest.raises(ValueError, match="does not fill"):
        pool.scatter([0, 1], bytes(10))


def test_pattern_differs_between_requests_and_positions() -> None:
    pool = KVPool(num_blocks=4, block_size=2, kv_bytes_per_token=8)
    pool.write_tokens(request_key("a"), [0], 0, 2)
    pool.write_tokens(request_key("b"), [1], 0, 2)
    rows = pool.data.reshape(8, 8)
    assert len({rows[i].tobytes() for i in range(4)}) == 4


def test_kv_bytes_must_be_a_multiple_of_eight() -> None:
    with pytest.raises(ValueError):
        KVPool(num_blocks=4, block_size=4, kv_bytes_per_token=12)
