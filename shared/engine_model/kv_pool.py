"""Real bytes behind the simulated KV blocks, so that migration moves and checks actual data.

Layout: one uint8 array [num_blocks, block_size * kv_bytes_per_token]; token position p of a
request lives in block `block_ids[p // block_size]` at slot `p % block_size`. When the engine
computes a token it writes a pattern derived from (request key, position), so the destination
of a migration can verify every byte it received.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_WORD_STRIDE = np.uint64(0xD6E8FEB86659FD93)


def request_key(request_id: str, seed: int = 0) -> int:
    """A stable 64-bit key per request (Python's str hash is salted per process)."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def token_pattern(key: int, positions: np.ndarray, words_per_token: int) -> np.ndarray:
    """uint64 [len(positions), words_per_token]: splitmix64 of (key, position, word)."""
    x = positions.astype(np.uint64)[:, None] * _GOLDEN + np.uint64(key)
    x = x + np.arange(words_per_token, dtype=np.uint64)[None, :] * _WORD_STRIDE
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return x


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, kv_bytes_per_token: int) -> None:
        if kv_bytes_per_token <= 0 or kv_bytes_per_token % 8:
            raise ValueError("kv_bytes_per_token must be a positive multiple of 8")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.block_bytes = block_size * kv_bytes_per_token
        self.data = np.zeros((num_blocks, self.block_bytes), dtype=np.uint8)
        self._token_rows = self.data.reshape(num_blocks * block_size, kv_bytes_per_token)  # a view

    def _rows(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        blocks = np.asarray(block_ids, dtype=np.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write_tokens(self, key: int, block_ids: Sequence[int], start: int, end: int) -> None:
        """Fill token positions [start, end) of a request (its blocks in table order)."""
        if end <= start:
            return
        assert end <= len(block_ids) * self.block_size, (end, len(block_ids))
        pattern = token_pattern(key, np.arange(start, end), self.kv_bytes_per_token // 8)
        self._token_rows[self._rows(block_ids, start, end)] = pattern.view(np.uint8)

    def verify(self, key: int, block_ids: Sequence[int], num_tokens: int) -> bool:
        """True if positions [0, num_tokens) hold exactly the request's pattern."""
        if num_tokens > len(block_ids) * self.block_size:
            return False
        if num_tokens == 0:
            return True
        expected = token_pattern(key, np.arange(num_tokens), self.kv_bytes_per_token // 8).view(np.uint8)
        return bool(np.array_equal(self._token_rows[self._rows(block_ids, 0, num_tokens)], expected))

    def gather(self, block_ids: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Block fusion: the given blocks, in order, as one contiguous [n, block_bytes] buffer
        (written into `out` when given, e.g. a reused staging buffer)."""
        indices = np.asarray(block_ids, dtype=np.int64)
        if out is None:
            return np.take(self.data, indices, axis=0)
        if out.shape != (len(indices), self.block_bytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"gather buffer must be contiguous uint8 {(len(indices), self.block_bytes)}")
        return np.take(self.data, indices, axis=0, out=out)

    def scatter(self, block_ids: Sequence[int], buffer: np.ndarray | bytes | memoryview) -> None:
        """Write a fused buffer (as produced by `gather`) into the given blocks, in order."""
        flat = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer.reshape(-1)
        if flat.size != len(block_ids) * self.block_bytes:
            raise ValueError(f"buffer of {flat.size} bytes does not fill {len(block_ids)} blocks of {self.block_bytes}")
        self.data[np.asarray(block_ids, dtype=np.int64)] = flat.reshape(len(block_ids), self.block_bytes)
