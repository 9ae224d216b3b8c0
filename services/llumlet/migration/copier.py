"""Block fusion: a request's scattered KV blocks ↔ one contiguous host buffer.

The source gathers the blocks of a frame into a preallocated staging buffer (reused across
frames and migrations, grown when a frame needs more) so that the data plane ships one large
write instead of a write per block; the destination scatters a received buffer into its reserved
blocks. Layout of a fused buffer of n blocks: for each KV region in order, that region's slice for
the n blocks (block index replaced by 0..n-1), contiguous.

Three paths, picked per region type:
- numpy arrays (the simulated engine): `np.take(..., out=)` / fancy assignment;
- torch CPU tensors (vLLM's CPU backend): `index_select(out=)` / `index_copy_`;
- torch CUDA tensors: the gather runs on a side stream into a device staging buffer, then a
  non-blocking copy into pinned host memory; an event tells when it is done, so inference on the
  default stream is never blocked (Llumnix §5).

Large copies run in the copier's own worker threads (numpy and torch release the GIL), so the
event loop keeps running decode steps; small ones (the last stage) run inline, saving the hop.

Token slots: where every region names its token dimension and lives in host memory, the copier
also moves single token slots (`gather_tokens` / `scatter_tokens`: the slots of a block not yet
full, for the wire's token frames). Layout of a token-fused buffer of n slots: for each region in
order, its [n, rest...] slice (block and token dimensions first, then the others in order).
Device memory moves whole blocks only (token frames are not built for CUDA here: no GPU to test
them on).

Plain host memory (numpy arrays, contiguous torch CPU tensors) needs neither: `block_views`
describes a frame as views of the KV memory itself, in fused order, so the sender hands them to
one vectored send and a receiver can read into them (the kernel's socket copies are the only
copies). On the 2-core CI machine a gather or scatter costs ~0.08 CPU-s/GB, next to ~0.2 for
each side of the loopback TCP copy itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.llumlet.migration.ops import KVRegion

INLINE_COPY_MAX_BYTES = 1 << 20  # below this, a thread hop costs more than the copy
# A frame is shipped from views of the KV memory when its pieces average at least this much;
# smaller pieces (a vector entry each, built in Python) cost more than gathering them.
MIN_VIEW_BYTES = 16 << 10
_NUM_SLOTS = 2  # staging buffers: gather frame k+1 while frame k is on the wire


def _is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.startswith("torch")


@dataclass(frozen=True)
class _RegionLayout:
    region: KVRegion
    block_bytes: int  # bytes of one block's slice

    @staticmethod
    def of(region: KVRegion) -> _RegionLayout:
        tensor = region.tensor
        num_blocks = tensor.shape[region.block_dim]
        nbytes = tensor.nbytes if not _is_torch(tensor) else tensor.numel() * tensor.element_size()
        assert num_blocks > 0 and nbytes % num_blocks == 0, (tensor.shape, region.block_dim)
        return _RegionLayout(region, nbytes // num_blocks)

    def shape_for(self, num_blocks: int) -> tuple[int, ...]:
        shape = list(self.region.tensor.shape)
        shape[self.region.block_dim] = num_blocks
        return tuple(shape)

    def byte_rows(self) -> np.ndarray | None:
        """The region as uint8 [outer, blocks, piece bytes] (outer: the dimensions before the
        block one), a view of its memory; None unless it is a C-contiguous numpy array."""
        tensor, dim = self.region.tensor, self.region.block_dim
        if _is_torch(tensor) or not tensor.flags.c_contiguous:
            return None
        outer = int(np.prod(tensor.shape[:dim], dtype=np.int64))
        return tensor.reshape(-1).view(np.uint8).reshape(outer, tensor.shape[dim], self.block_bytes // outer)


def _host_view(region: KVRegion) -> KVRegion:
    """A contiguous torch CPU tensor as a numpy byte view of the same memory: numpy's take and
    fancy assignment run ~2x faster than index_select / index_copy_ (measured), and the fused
    bytes are the same either way (C order, the last dimension widened to bytes)."""
    tensor = region.tensor
    if _is_torch(tensor) and not tensor.is_cuda and tensor.is_contiguous() and tensor.dim() > region.block_dim + 1:
        import torch

        return KVRegion(tensor.view(torch.uint8).numpy(), region.block_dim, region.token_dim)
    return region


def _token_slots(layouts: Sequence[_RegionLayout]) -> int:
    """Token slots per block when every region can move single slots (numpy, a token dimension
    that is neither the block one nor the last, which a byte view widens); 0 otherwise."""
    slots = set()
    for layout in layouts:
        tensor, region = layout.region.tensor, layout.region
        if (_is_torch(tensor) or region.token_dim is None or region.token_dim == region.block_dim
                or region.token_dim >= tensor.ndim - 1):
            return 0
        slots.add(tensor.shape[region.token_dim])
    return slots.pop() if len(slots) == 1 else 0


def _token_rows(layout: _RegionLayout) -> np.ndarray:
    """The region as [blocks, slots, rest...] (a view: writes go through)."""
    region = layout.region
    return np.moveaxis(region.tensor, (region.block_dim, region.token_dim), (0, 1))


class BlockCopier:
    def __init__(self, regions: Sequence[KVRegion], initial_frame_bytes: int = 1 << 20) -> None:
        self.layouts = [_RegionLayout.of(_host_view(r)) for r in regions]
        self.block_bytes = sum(layout.block_bytes for layout in self.layouts)
        kinds = {self._kind(layout.region.tensor) for layout in self.layouts}
        if "cuda" in kinds and len(kinds) > 1:
            raise ValueError(f"KV regions of mixed kinds: {kinds}")
        self.kind = "none" if not kinds else "cuda" if "cuda" in kinds else "host"
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-copier")
        # Staging for the largest frame up front (a frame holds at least one block): on CUDA,
        # growing it mid-migration means cudaHostAlloc/cudaMalloc, which wait for the whole
        # device, so the copy would queue behind the step in flight (seen on an H100).
        initial = max(initial_frame_bytes, self.block_bytes)
        self._backend = (_CudaBackend(self.layouts, initial) if self.kind == "cuda"
                         else _HostBackend(self.layouts))
        self._staging = [self._backend.new_host_buffer(initial) for _ in range(_NUM_SLOTS)]
        if self.kind == "cuda":
            self._backend.warm_up(max(1, initial // max(self.block_bytes, 1)), self._staging[0])
        rows = [layout.byte_rows() for layout in self.layouts if layout.block_bytes]
        self._byte_rows = rows if self.kind == "host" and all(r is not None for r in rows) else None
        self.block_size = _token_slots(self.layouts) if self.kind == "host" else 0  # (0: whole blocks only)
        self.token_bytes = self.block_bytes // self.block_size if self.block_size else 0

    @staticmethod
    def _kind(tensor: Any) -> str:
        if not _is_torch(tensor):
            return "numpy"
        return "cuda" if tensor.is_cuda else "torch"

    def frame_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes

    def new_host_buffer(self, nbytes: int) -> np.ndarray:
        """A receive buffer the scatter path likes best (pinned memory on CUDA)."""
        return self._backend.new_host_buffer(nbytes)

    async def gather(self, block_ids: Sequence[int], slot: int) -> memoryview:
        """The blocks fused into staging buffer `slot`; the view stays valid until the next
        gather into the same slot."""
        nbytes = self.frame_bytes(len(block_ids))
        if self._staging[slot].nbytes < nbytes:
            self._staging[slot] = self._backend.new_host_buffer(_grown(nbytes))
        out = self._staging[slot][:nbytes]
        if nbytes:
            await self._run(nbytes, self._backend.gather, list(block_ids), out)
        return memoryview(out)

    def token_frame_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.token_bytes

    def _slots(self, table: Sequence[int], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, slots) of token positions [start, stop) of a request whose blocks are
        `table` (position p: slot p % block_size of block table[p // block_size])."""
        assert self.block_size, "this KV layout moves whole blocks only"
        positions = np.arange(start, stop, dtype=np.int64)
        if stop > len(table) * self.block_size or start < 0:
            raise IndexError(f"tokens [{start}, {stop}) outside {len(table)} blocks")
        blocks = np.asarray(table, dtype=np.int64)[positions // self.block_size] if len(positions) else positions
        num_blocks = min(layout.region.tensor.shape[layout.region.block_dim] for layout in self.layouts)
        if len(blocks) and not (0 <= blocks.min() and blocks.max() < num_blocks):
            raise IndexError(f"block id out of range (pool of {num_blocks})")
        return blocks, positions % self.block_size

    def gather_tokens(self, table: Sequence[int], start: int, stop: int, slot: int) -> memoryview:
        """Token positions [start, stop) fused into staging buffer `slot` (token-fused order).
        Synchronous: a few slots, whose bytes go out at once (no trip around the event loop, in
        the downtime every hop counts)."""
        nbytes = self.token_frame_bytes(stop - start)
        if self._staging[slot].nbytes < nbytes:
            self._staging[slot] = self._backend.new_host_buffer(_grown(nbytes))
        out = self._staging[slot][:nbytes]
        blocks, slots = self._slots(table, start, stop)
        for layout, chunk in _token_views(self.layouts, out, len(blocks), self.block_size):
            rows = _token_rows(layout)
            chunk.view(rows.dtype).reshape((len(blocks),) + rows.shape[2:])[...] = rows[blocks, slots]
        return memoryview(out)

    def scatter_tokens(self, table: Sequence[int], start: int, stop: int, payload: memoryview | np.ndarray) -> None:
        """Write a token-fused buffer into token positions [start, stop) of `table`'s blocks
        (synchronous, as `gather_tokens`)."""
        flat = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload.reshape(-1)
        if flat.nbytes != self.token_frame_bytes(stop - start):
            raise ValueError(f"{flat.nbytes} bytes do not fill {stop - start} token slots of {self.token_bytes}")
        blocks, slots = self._slots(table, start, stop)
        for layout, chunk in _token_views(self.layouts, flat, len(blocks), self.block_size):
            rows = _token_rows(layout)
            rows[blocks, slots] = chunk.view(rows.dtype).reshape((len(blocks),) + rows.shape[2:])

    def block_views(self, block_ids: Sequence[int]) -> list[memoryview] | None:
        """The fused bytes of these blocks as (writable) views of the KV memory itself, in fused
        order (runs of consecutive blocks merged), or None where a gather or scatter is needed
        (not plain host memory, or pieces too small to be worth a vector entry each). A sender
        ships a frame from them; a receiver can read a frame straight into them. They alias live
        KV blocks: they hold a frame only while nothing else writes those blocks."""
        if not self._byte_rows or not block_ids:
            return None
        runs = _consecutive_runs(block_ids, min(rows.shape[1] for rows in self._byte_rows))
        num_pieces = len(runs) * sum(rows.shape[0] for rows in self._byte_rows)
        if self.frame_bytes(len(block_ids)) < num_pieces * MIN_VIEW_BYTES:
            return None
        views = [memoryview(rows[outer, start:stop].reshape(-1))
                 for rows in self._byte_rows for outer in range(rows.shape[0]) for start, stop in runs]
        assert sum(v.nbytes for v in views) == self.frame_bytes(len(block_ids))
        return views

    async def scatter(self, block_ids: Sequence[int], payload: memoryview | np.ndarray) -> None:
        """Write a fused buffer into the given (reserved) blocks, in order."""
        flat = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload.reshape(-1)
        if flat.nbytes != self.frame_bytes(len(block_ids)):
            raise ValueError(f"{flat.nbytes} bytes do not fill {len(block_ids)} blocks of {self.block_bytes}")
        if flat.nbytes:
            await self._run(flat.nbytes, self._backend.scatter, list(block_ids), flat)

    async def _run(self, nbytes: int, fn, *args) -> None:
        if nbytes <= INLINE_COPY_MAX_BYTES and self.kind != "cuda":
            fn(*args)
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _consecutive_runs(block_ids: Sequence[int], num_blocks: int) -> list[tuple[int, int]]:
    """[start, stop) ranges covering the ids in order; an id outside the pool is an error (a
    slice would silently clip it)."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if not 0 <= block < num_blocks:
            raise IndexError(f"block id {block} out of range (pool of {num_blocks})")
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs


def _grown(nbytes: int) -> int:
    return 1 << (nbytes - 1).bit_length()  # next power of two: few reallocations


def _views(layouts: Sequence[_RegionLayout], flat: Any, num_blocks: int):
    """(layout, slice of `flat` for that region) in fused-buffer order."""
    offset = 0
    for layout in layouts:
        size = layout.block_bytes * num_blocks
        yield layout, flat[offset : offset + size]
        offset += size


def _token_views(layouts: Sequence[_RegionLayout], flat: Any, num_tokens: int, block_size: int):
    """(layout, slice of `flat` for that region) in token-fused order."""
    offset = 0
    for layout in layouts:
        size = layout.block_bytes // block_size * num_tokens
        yield layout, flat[offset : offset + size]
        offset += size


class _HostBackend:
    """numpy arrays and torch CPU tensors; runs synchronously (in a worker thread or inline)."""

    def __init__(self, layouts: Sequence[_RegionLayout]) -> None:
        self.layouts = layouts

    def new_host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def gather(self, block_ids: list[int], out: np.ndarray) -> None:
        n = len(block_ids)
        indices = np.asarray(block_ids, dtype=np.int64)
        for layout, chunk in _views(self.layouts, out, n):
            tensor, dim = layout.region.tensor, layout.region.block_dim
            if _is_torch(tensor):
                import torch

                dst = torch.frombuffer(chunk, dtype=tensor.dtype).view(layout.shape_for(n))
                torch.index_select(tensor, dim, torch.from_numpy(indices), out=dst)
            else:
                assert 0 <= indices.min() and indices.max() < tensor.shape[dim], "block id out of range"
                dst = chunk.view(tensor.dtype).reshape(layout.shape_for(n))
                # mode="clip": with the default ("raise") numpy buffers `out`, 4x slower; the
                # range was checked above.
                np.take(tensor, indices, axis=dim, out=dst, mode="clip")

    def scatter(self, block_ids: list[int], flat: np.ndarray) -> None:
        n = len(block_ids)
        indices = np.asarray(block_ids, dtype=np.int64)
        for layout, chunk in _views(self.layouts, flat, n):
            tensor, dim = layout.region.tensor, layout.region.block_dim
            if _is_torch(tensor):
                import torch

                src = torch.frombuffer(chunk, dtype=tensor.dtype).view(layout.shape_for(n))
                tensor.index_copy_(dim, torch.from_numpy(indices), src)
            else:
                tensor[(slice(None),) * dim + (indices,)] = chunk.view(tensor.dtype).reshape(layout.shape_for(n))


class _CudaBackend:
    """Gather on a side stream into device staging, then non-blocking D2H into pinned memory;
    scatter the other way. Each call blocks its (worker) thread on a CUDA event only."""

    def __init__(self, layouts: Sequence[_RegionLayout], initial_bytes: int) -> None:
        import torch

        self.torch = torch
        self.layouts = layouts
        self.device = layouts[0].region.tensor.device
        self.stream = torch.cuda.Stream(device=self.device)
        self._device_staging = torch.empty(initial_bytes, dtype=torch.uint8, device=self.device)

    def new_host_buffer(self, nbytes: int) -> np.ndarray:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True).numpy()

    def warm_up(self, max_frame_blocks: int, host: np.ndarray) -> None:
        """Run the gather and scatter kernels once for the smallest and the largest frame, before
        any migration: CUDA loads a kernel lazily on its first launch, and that load waits for
        the whole device, so a stage's first copy would queue behind the step in flight (seen on
        an H100: 290 ms behind queued work, then 1 ms). The blocks keep their bytes: each is
        written back with what was just read from it (at start-up, before any request)."""
        num_blocks = min(layout.region.tensor.shape[layout.region.block_dim] for layout in self.layouts)
        for count in sorted({1, min(max_frame_blocks, num_blocks)}):
            ids = list(range(count))
            out = host[: count * sum(layout.block_bytes for layout in self.layouts)]
            self.gather(ids, out)
            self.scatter(ids, out)
        self.torch.cuda.synchronize(self.device)

    def _device_buffer(self, nbytes: int):
        if self._device_staging.numel() < nbytes:
            self._device_staging = self.torch.empty(_grown(nbytes), dtype=self.torch.uint8, device=self.device)
        return self._device_staging[:nbytes]

    def gather(self, block_ids: list[int], out: np.ndarray) -> None:
        torch, n = self.torch, len(block_ids)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            staging = self._device_buffer(out.nbytes)
            index = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            for layout, chunk in _views(self.layouts, staging, n):
                tensor = layout.region.tensor
                dst = chunk.view(tensor.dtype).view(layout.shape_for(n))
                torch.index_select(tensor, layout.region.block_dim, index, out=dst)
            torch.from_numpy(out).copy_(staging, non_blocking=True)
            done.record(self.stream)
        done.synchronize()

    def scatter(self, block_ids: list[int], flat: np.ndarray) -> None:
        torch, n = self.torch, len(block_ids)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            staging = self._device_buffer(flat.nbytes)
            staging.copy_(torch.from_numpy(flat), non_blocking=True)
            index = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            for layout, chunk in _views(self.layouts, staging, n):
                tensor = layout.region.tensor
                tensor.index_copy_(layout.region.block_dim, index, chunk.view(tensor.dtype).view(layout.shape_for(n)))
            done.record(self.stream)
        done.synchronize()
