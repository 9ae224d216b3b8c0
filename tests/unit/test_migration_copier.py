"""Block fusion: gather scattered blocks into one buffer and scatter it back, for every backend."""

from __future__ import annotations

import numpy as np
import pytest

from services.llumlet.migration import copier as copier_module
from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.ops import KVRegion

BLOCKS = [9, 0, 4, 7, 2]


async def round_trip(src_regions, dst_regions, block_ids, dst_ids) -> None:
    src, dst = BlockCopier(src_regions), BlockCopier(dst_regions)
    try:
        fused = await src.gather(block_ids, slot=0)
        assert fused.nbytes == len(block_ids) * src.block_bytes
        await dst.scatter(dst_ids, fused)
    finally:
        src.close()
        dst.close()


async def test_numpy_blocks_round_trip_into_other_block_ids() -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (10, 64), dtype=np.uint8)
    dst = np.zeros_like(src)
    await round_trip([KVRegion(src)], [KVRegion(dst)], BLOCKS, [1, 2, 3, 5, 8])
    np.testing.assert_array_equal(dst[[1, 2, 3, 5, 8]], src[BLOCKS])
    assert not dst[[0, 4, 6, 7, 9]].any()  # nothing else was touched


async def test_fused_layout_is_region_after_region() -> None:
    """Two regions, the second with blocks on dimension 1 (vLLM's [2, blocks, ...] layout)."""
    keys = np.arange(10 * 8, dtype=np.float32).reshape(10, 8)
    kv = np.arange(2 * 10 * 4, dtype=np.int16).reshape(2, 10, 4)
    copier = BlockCopier([KVRegion(keys, 0), KVRegion(kv, 1)])
    assert copier.block_bytes == 8 * 4 + 2 * 4 * 2
    fused = np.frombuffer(await copier.gather([3, 1], 0), dtype=np.uint8)
    expected = np.concatenate([keys[[3, 1]].view(np.uint8).ravel(), kv[:, [3, 1]].view(np.uint8).ravel()])
    np.testing.assert_array_equal(fused, expected)
    copier.close()


async def test_blocks_on_dimension_one_round_trip() -> None:
    src = np.random.default_rng(1).standard_normal((2, 10, 3, 4)).astype(np.float16)
    dst = np.zeros_like(src)
    await round_trip([KVRegion(src, 1)], [KVRegion(dst, 1)], BLOCKS, BLOCKS[::-1])
    np.testing.assert_array_equal(dst[:, BLOCKS[::-1]], src[:, BLOCKS])


async def test_torch_cpu_tensors_round_trip() -> None:
    torch = pytest.importorskip("torch")
    src = torch.randn(2, 10, 4, 8, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    await round_trip([KVRegion(src, 1)], [KVRegion(dst, 1)], BLOCKS, [0, 1, 2, 3, 4])
    assert torch.equal(dst[:, :5], src[:, BLOCKS])


async def test_large_copies_run_off_the_event_loop(monkeypatch) -> None:
    monkeypatch.setattr(copier_module, "INLINE_COPY_MAX_BYTES", 0)
    src = np.random.default_rng(2).integers(0, 256, (10, 4096), dtype=np.uint8)
    dst = np.zeros_like(src)
    await round_trip([KVRegion(src)], [KVRegion(dst)], BLOCKS, BLOCKS)
    np.testing.assert_array_equal(dst[BLOCKS], src[BLOCKS])


async def test_staging_buffers_are_reused_and_grown() -> None:
    pool = np.arange(10 * 1024, dtype=np.uint8).reshape(10, 1024) % 251
    copier = BlockCopier([KVRegion(pool)], initial_frame_bytes=2048)
    first = await copier.gather([1, 2], 0)
    staging = copier._staging[0]
    assert np.shares_memory(np.frombuffer(first, np.uint8), staging)
    await copier.gather([3], 0)
    assert copier._staging[0] is staging  # reused: no allocation per stage
    bigger = await copier.gather(list(range(10)), 0)
    assert copier._staging[0].nbytes >= 10 * 1024  # grown once
    np.testing.assert_array_equal(np.frombuffer(bigger, np.uint8).reshape(10, 1024), pool)
    other = await copier.gather([5], 1)  # the second slot is independent of the first
    np.testing.assert_array_equal(np.frombuffer(bigger, np.uint8).reshape(10, 1024), pool)
    np.testing.assert_array_equal(np.frombuffer(other, np.uint8), pool[5])
    copier.close()


async def test_payload_of_the_wrong_size_is_refused() -> None:
    pool = np.zeros((4, 16), dtype=np.uint8)
    copier = BlockCopier([KVRegion(pool)])
    with pytest.raises(ValueError, match="do not fill"):
        await copier.scatter([0, 1], memoryview(bytes(31)))
    copier.close()


async def test_no_kv_regions_means_empty_frames() -> None:
    copier = BlockCopier([])
    assert copier.block_bytes == 0 and copier.kind == "none"
    assert (await copier.gather([1, 2, 3], 0)).nbytes == 0
    await copier.scatter([1, 2, 3], memoryview(b""))
    copier.close()


async def test_torch_and_numpy_paths_fuse_the_same_bytes() -> None:
    """A non-contiguous torch tensor takes the index_select path, a contiguous one the numpy
    byte view: the fused buffers must be identical, so instances interoperate."""
    torch = pytest.importorskip("torch")
    base = torch.randn(4, 10, 2, 8, dtype=torch.float16)  # blocks on dim 1 of a [4, blocks, ...] tensor
    strided = base.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    assert not strided.is_contiguous()
    fast, slow = BlockCopier([KVRegion(base, 1)]), BlockCopier([KVRegion(strided, 1)])
    assert bytes(await fast.gather(BLOCKS, 0)) == bytes(await slow.gather(BLOCKS, 0))
    fast.close()
    slow.close()


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
async def test_cuda_side_stream_gather_into_pinned_memory_round_trips() -> None:
    import torch

    src = torch.randn(2, 64, 16, 8, 128, dtype=torch.float16, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()  # as in an engine: a stage copies blocks of steps already finished
    ids = [5, 63, 0, 17, 9, 33]
    src_copier, dst_copier = BlockCopier([KVRegion(src, 1)]), BlockCopier([KVRegion(dst, 1)])
    assert src_copier.kind == "cuda"
    assert torch.from_numpy(src_copier._staging[0]).is_pinned()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        busy = busy @ busy  # work queued on the default stream meanwhile
        busy /= busy.norm()
    fused = await src_copier.gather(ids, 0)
    await dst_copier.scatter(list(range(6)), fused)
    torch.cuda.synchronize()
    assert torch.equal(dst[:, :6], src[:, ids])
    assert not dst[:, 6:].any()
    src_copier.close()
    dst_copier.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
async def test_cuda_gather_does_not_wait_for_the_default_stream() -> None:
    """The point of the side stream (Llumnix §5): a stage's copy completes while inference work
    queued on the default stream is still running, so the step is never stalled behind it."""
    import torch

    src = torch.randn(2, 256, 16, 8, 128, dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()
    copier = BlockCopier([KVRegion(src, 1)], initial_frame_bytes=16 << 20)  # as the llumlet sizes it
    a = torch.randn(8192, 8192, dtype=torch.float16, device="cuda")
    for ids in ([7], list(range(0, 256, 3)), list(range(1, 200, 2)), list(range(256))):
        step_done = torch.cuda.Event()
        for _ in range(100):  # ~1 TFLOP each: over 100 ms of default-stream work
            a = torch.tanh(a @ a)
        step_done.record()
        fused = await copier.gather(ids, 0)
        assert not step_done.query(), f"a gather of {len(ids)} blocks waited for the default stream"
        step_done.synchronize()
        expected = src[:, ids].contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
        assert bytes(fused) == expected.tobytes()
    copier.close()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
async def test_cuda_vllm_layout_many_layers_bf16_round_trip_and_growth() -> None:
    """vLLM's CUDA layout: one [2, blocks, block_size, heads, head_size] region per layer; a
    frame larger than the initial staging grows it; bytes survive gather → scatter exactly."""
    import torch

    layers = [torch.randn(2, 128, 16, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(6)]
    targets = [torch.zeros_like(t) for t in layers]
    torch.cuda.synchronize()
    src, dst = BlockCopier([KVRegion(t, 1) for t in layers], initial_frame_bytes=4096), \
        BlockCopier([KVRegion(t, 1) for t in targets])
    ids = list(range(127, -1, -2))
    into = list(range(64))
    fused = await src.gather(ids, 1)
    assert len(fused) == src.frame_bytes(len(ids)) > 4096
    await dst.scatter(into, fused)
    torch.cuda.synchronize()
    for layer, target in zip(layers, targets):
        assert torch.equal(target[:, :64], layer[:, ids])
        assert not target[:, 64:].any()
    # The host path and the CUDA path fuse the same bytes (instances of both kinds interoperate).
    host = BlockCopier([KVRegion(t.cpu(), 1) for t in layers])
    assert bytes(await host.gather(ids, 0)) == bytes(fused)
    for copier in (src, dst, host):
        copier.close()


# -- block views: frames sent from (or received into) the KV memory itself ------------------------


@pytest.fixture
def any_piece_size(monkeypatch):
    """Views even for the tiny blocks of these tests (production wants pieces of >= 16 KiB)."""
    monkeypatch.setattr(copier_module, "MIN_VIEW_BYTES", 1)


async def test_block_views_hold_the_gathered_bytes(any_piece_size) -> None:
    """Both region layouts ([blocks, ...] and vLLM's [2, blocks, ...]), regions one after another."""
    keys = np.arange(10 * 8, dtype=np.float32).reshape(10, 8)
    kv = np.arange(2 * 10 * 4, dtype=np.int16).reshape(2, 10, 4)
    copier = BlockCopier([KVRegion(keys, 0), KVRegion(kv, 1)])
    ids = [3, 4, 1, 9, 8]
    views = copier.block_views(ids)
    assert views is not None
    assert b"".join(views) == bytes(await copier.gather(ids, 0))
    copier.close()


async def test_torch_cpu_block_views_hold_the_gathered_bytes(any_piece_size) -> None:
    torch = pytest.importorskip("torch")
    copier = BlockCopier([KVRegion(torch.randn(2, 10, 4, 8, dtype=torch.bfloat16), 1)])
    views = copier.block_views(BLOCKS)
    assert views is not None and b"".join(views) == bytes(await copier.gather(BLOCKS, 0))
    copier.close()


def test_consecutive_blocks_share_one_view(any_piece_size) -> None:
    copier = BlockCopier([KVRegion(np.zeros((10, 64), np.uint8))])
    views = copier.block_views([2, 3, 4, 7, 8, 0])
    assert [v.nbytes for v in views] == [3 * 64, 2 * 64, 64]
    copier.close()


def test_block_views_write_through_to_the_blocks(any_piece_size) -> None:
    """A receiver reading into the views fills the blocks themselves, in fused order."""
    pool = np.zeros((10, 64), np.uint8)
    copier = BlockCopier([KVRegion(pool)])
    payload = np.random.default_rng(3).integers(0, 256, 3 * 64, dtype=np.uint8)
    offset = 0
    for view in copier.block_views([6, 2, 3]):
        view[:] = payload[offset : offset + view.nbytes].tobytes()
        offset += view.nbytes
    np.testing.assert_array_equal(pool[[6, 2, 3]].ravel(), payload)
    assert not pool[[0, 1, 4, 5, 7, 8, 9]].any()
    copier.close()


def test_block_id_outside_the_pool_is_an_error(any_piece_size) -> None:
    copier = BlockCopier([KVRegion(np.zeros((10, 64), np.uint8))])
    for bad in (10, -1):
        with pytest.raises(IndexError):
            copier.block_views([1, bad])
    copier.close()


def test_small_pieces_are_gathered_instead() -> None:
    copier = BlockCopier([KVRegion(np.zeros((10, 64), np.uint8))])  # 64-byte pieces
    assert copier.block_views([1, 5]) is None
    copier.close()
    big = BlockCopier([KVRegion(np.zeros((4, copier_module.MIN_VIEW_BYTES), np.uint8))])
    assert big.block_views([1, 3]) is not None
    big.close()


def test_strided_tensors_are_gathered_instead(any_piece_size) -> None:
    torch = pytest.importorskip("torch")
    strided = torch.randn(4, 10, 2, 8).transpose(0, 1).contiguous().transpose(0, 1)
    copier = BlockCopier([KVRegion(strided, 1)])
    assert copier.block_views(BLOCKS) is None
    copier.close()
    empty = BlockCopier([])  # no KV bytes at all
    assert empty.block_views([1]) is None
    empty.close()


# -- token slots (the wire's token frames) -------------------------------------------------------


def test_token_slots_round_trip_into_other_blocks_and_touch_nothing_else() -> None:
    """[blocks, heads, slots, dim] (vLLM CPU's layout) and [blocks, slots, bytes] (the simulated
    engine's), two regions: positions [3, 10) of a 4-slot table land in the same positions of
    another table, and no other slot is written."""
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, (10, 3, 4, 6), dtype=np.uint8), rng.integers(0, 256, (10, 4, 8), dtype=np.uint8)]
    dst = [np.zeros_like(a) for a in src]
    a = BlockCopier([KVRegion(src[0], 0, 2), KVRegion(src[1], 0, 1)])
    b = BlockCopier([KVRegion(dst[0], 0, 2), KVRegion(dst[1], 0, 1)])
    assert a.block_size == 4 and a.token_bytes == a.block_bytes // 4 == 3 * 6 + 8
    fused = a.gather_tokens([5, 2, 7], 3, 10, slot=0)
    assert fused.nbytes == a.token_frame_bytes(7)
    b.scatter_tokens([1, 8, 9], 3, 10, fused)
    expected = [np.zeros_like(x) for x in src]
    for p in range(3, 10):
        (s_block, d_block), slot = ([5, 2, 7][p // 4], [1, 8, 9][p // 4]), p % 4
        expected[0][d_block, :, slot] = src[0][s_block, :, slot]
        expected[1][d_block, slot] = src[1][s_block, slot]
    assert all(np.array_equal(x, y) for x, y in zip(dst, expected))
    with pytest.raises(ValueError):
        b.scatter_tokens([1, 8, 9], 3, 10, fused[:-1])
    with pytest.raises(IndexError):
        a.gather_tokens([5, 2], 3, 10, slot=0)  # past the table
    a.close()
    b.close()


def test_layouts_without_token_slots_move_whole_blocks_only() -> None:
    pool = np.zeros((4, 2, 8), dtype=np.uint8)
    other_slots = np.zeros((4, 3, 8), np.uint8)
    for regions in ([KVRegion(pool)], [KVRegion(pool, 0, 2)], [KVRegion(pool, 0, 1), KVRegion(other_slots, 0, 1)]):
        copier = BlockCopier(regions)  # no token dim; the last (a byte view widens it); slots differ
        assert copier.token_bytes == 0 and copier.block_size == 0
        copier.close()


def test_torch_cpu_token_slots_round_trip() -> None:
    torch = pytest.importorskip("torch")
    src = torch.arange(8 * 2 * 4 * 6, dtype=torch.float16).reshape(8, 2, 4, 6)
    dst = torch.zeros_like(src)
    a, b = BlockCopier([KVRegion(src, 0, 2)]), BlockCopier([KVRegion(dst, 0, 2)])
    b.scatter_tokens([3, 1], 2, 7, a.gather_tokens([6, 0], 2, 7, slot=1))
    assert torch.equal(dst[3, :, 2:], src[6, :, 2:]) and torch.equal(dst[1, :, :3], src[0, :, :3])
    assert dst[3, :, :2].abs().sum() == 0 and dst[1, :, 3:].abs().sum() == 0
    a.close()
    b.close()
