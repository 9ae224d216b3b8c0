"""Block-fusion copier on a GPU: what a migration stage costs and what it costs inference.

    python -m benchmarks.copier_cuda [--device cuda] [--lengths 256,1024,4096]
        [--pool-blocks 2048] [--repeats 5] [--out results/copier_cuda.json]

The KV cache is laid out as vLLM's CUDA backend lays it out (one region per layer,
[2, blocks, block_size, kv_heads, head_size], fp16), by default Llama-2-7B's shape (32 layers, 32
KV heads of 128, 16 tokens a block: 16 MiB per block across layers). Three measurements:

1. Gather (device → pinned host) and scatter (host → device) of one request's blocks, scattered
   over the pool, through `BlockCopier` (block fusion: one index_select per region into device
   staging on a side stream, one D2H copy) against the unfused copy a naive migration would do
   (one synchronous copy per block per layer, 32 × blocks copies). GB/s and the ratio.
2. Interference (Llumnix §5: migration must not slow inference): the time of a decode-like step
   on the default stream (a memory-bound pass over --weights-gib of weights, as a 7B decode step
   is) alone, and while the copier gathers a 4,096-token request back to back in its worker
   thread. Median and P99 step time, and the ratio. Also the same with the gather on the default
   stream (what the copier's side stream avoids: the step then waits for the copy).
3. A round trip checks the bytes: gather on one pool, scatter into another, compare.
4. The data plane end to end: one stage of the request's blocks from a CUDA pool through the
   sender (gather on the side stream, CRC, framed over loopback TCP) into the receiver (scatter
   into a second CUDA pool), both ends on one event loop as in the transfer tests. GB/s, beside
   what bounds it on the host: a plain loopback TCP copy of the same bytes from one event loop
   (both ends) and the data plane's CRC-32 over them.

With --device cpu the same runs on torch CPU tensors (steps 1 and 3 only), to check the script.
The numbers are this one machine's; the JSON records the device name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import socket
import threading
import time
from pathlib import Path

import numpy as np

from services.llumlet.migration.copier import BlockCopier
from services.llumlet.migration.kv_receiver import KVReceiver
from services.llumlet.migration.kv_sender import KVSenderPool
from services.llumlet.migration.kv_wire import AckStatus, FrameHeader, payload_crc32
from services.llumlet.migration.ops import KVRegion
from services.llumlet.migration.protocol import MigrationLimits, new_migration_id
from tests.unit.kv_link_harness import PoolSink


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_pool(torch, args, device: str) -> list:
    shape = (2, args.pool_blocks, args.block_size, args.kv_heads, args.head_size)
    return [torch.randn(shape, dtype=torch.float16, device=device) for _ in range(args.layers)]


def unfused_gather(torch, layers: list, block_ids: list[int], out) -> None:
    """One synchronous copy per block per layer (K and V of a block are one strided slice)."""
    offset = 0
    for layer in layers:
        for block in block_ids:
            piece = layer[:, block]
            n = piece.numel()
            out[offset:offset + n].view(piece.shape).copy_(piece)
            offset += n


def unfused_scatter(torch, layers: list, block_ids: list[int], src) -> None:
    offset = 0
    for layer in layers:
        for block in block_ids:
            piece = layer[:, block]
            n = piece.numel()
            piece.copy_(src[offset:offset + n].view(piece.shape))
            offset += n


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def measure_copies(torch, args, device: str, src_layers: list, dst_layers: list) -> list[dict]:
    src = BlockCopier([KVRegion(t, 1) for t in src_layers])
    dst = BlockCopier([KVRegion(t, 1) for t in dst_layers])
    rng = np.random.default_rng(args.seed)
    rows = []
    for length in args.lengths:
        n = -(-length // args.block_size)
        nbytes = src.frame_bytes(n)
        pinned = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=device == "cuda")
        fused_g, fused_s, plain_g, plain_s = [], [], [], []
        for _ in range(args.repeats):
            ids = rng.choice(args.pool_blocks, size=n, replace=False).tolist()
            into = rng.choice(args.pool_blocks, size=n, replace=False).tolist()
            _sync(torch, device)
            t0 = time.perf_counter()
            fused = await src.gather(ids, 0)
            t1 = time.perf_counter()
            await dst.scatter(into, fused)
            _sync(torch, device)
            t2 = time.perf_counter()
            ok = all(torch.equal(d[:, into], s[:, ids]) for s, d in zip(src_layers, dst_layers))
            assert ok, "round trip changed the bytes"
            t3 = time.perf_counter()
            unfused_gather(torch, src_layers, ids, pinned)
            _sync(torch, device)
            t4 = time.perf_counter()
            unfused_scatter(torch, dst_layers, into, pinned)
            _sync(torch, device)
            t5 = time.perf_counter()
            fused_g.append(t1 - t0)
            fused_s.append(t2 - t1)
            plain_g.append(t4 - t3)
            plain_s.append(t5 - t4)
        row = {
            "tokens": length, "blocks": n, "bytes": nbytes,
            "fused_gather_ms": statistics.median(fused_g) * 1e3,
            "fused_scatter_ms": statistics.median(fused_s) * 1e3,
            "unfused_gather_ms": statistics.median(plain_g) * 1e3,
            "unfused_scatter_ms": statistics.median(plain_s) * 1e3,
        }
        row["fused_gather_gbps"] = nbytes / row["fused_gather_ms"] / 1e6
        row["fused_scatter_gbps"] = nbytes / row["fused_scatter_ms"] / 1e6
        row["gather_speedup"] = row["unfused_gather_ms"] / row["fused_gather_ms"]
        row["scatter_speedup"] = row["unfused_scatter_ms"] / row["fused_scatter_ms"]
        rows.append(row)
        print(f"{length:>6} tok {nbytes / 2**20:8.0f} MiB | fused gather {row['fused_gather_ms']:8.2f} ms "
              f"({row['fused_gather_gbps']:5.1f} GB/s) scatter {row['fused_scatter_ms']:8.2f} ms "
              f"({row['fused_scatter_gbps']:5.1f} GB/s) | unfused {row['unfused_gather_ms']:8.2f} / "
              f"{row['unfused_scatter_ms']:8.2f} ms | fusion {row['gather_speedup']:.1f}x / "
              f"{row['scatter_speedup']:.1f}x", flush=True)
    src.close()
    dst.close()
    return rows


class _LeaseSink(PoolSink):
    """The transfer tests' sink (frames land in `lease` in order), telling when a stage is in."""

    def __init__(self, copier: BlockCopier) -> None:
        super().__init__(copier, [])
        self.done = asyncio.Event()

    def expect(self, migration_id: str, lease: list[int]) -> None:
        self.migration_id, self.lease, self.filled = migration_id, lease, 0
        self.done.clear()

    async def write(self, header: FrameHeader, payload: memoryview) -> AckStatus:
        status = await super().write(header, payload)
        if self.filled == len(self.lease):
            self.done.set()
        return status

    def frame_failed(self, header: FrameHeader, status: AckStatus) -> None:
        raise AssertionError(f"frame refused: {status}")


async def raw_loopback_gbps(nbytes: int, piece: int = 4 << 20) -> float:
    """A plain TCP copy of nbytes over loopback, both ends on this event loop (like for like)."""
    loop = asyncio.get_running_loop()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    for sock in (client, peer):
        sock.setblocking(False)
    data, sink = memoryview(bytearray(nbytes)), memoryview(bytearray(piece))

    async def receive() -> None:
        left = nbytes
        while left:
            left -= await loop.sock_recv_into(peer, sink[: min(piece, left)])

    t0 = time.perf_counter()
    await asyncio.gather(loop.sock_sendall(client, data), receive())
    elapsed = time.perf_counter() - t0
    for sock in (client, peer, server):
        sock.close()
    return nbytes / elapsed / 1e9


async def measure_data_plane(torch, args, src_layers: list, dst_layers: list) -> list[dict]:
    limits = MigrationLimits()
    frame = limits.effective_frame_bytes()
    src = BlockCopier([KVRegion(t, 1) for t in src_layers], initial_frame_bytes=frame)
    dst = BlockCopier([KVRegion(t, 1) for t in dst_layers], initial_frame_bytes=frame)
    sink = _LeaseSink(dst)
    receiver = KVReceiver(sink, limits, dst.new_host_buffer)
    address = await receiver.start()
    senders = KVSenderPool(limits)
    rng = np.random.default_rng(args.seed + 2)
    rows = []
    for length in args.lengths:
        n = -(-length // args.block_size)
        times = []
        for _ in range(args.repeats):
            ids = rng.choice(args.pool_blocks, size=n, replace=False).tolist()
            lease = rng.choice(args.pool_blocks, size=n, replace=False).tolist()
            migration_id = new_migration_id()
            sink.expect(migration_id, lease)
            t0 = time.perf_counter()
            await senders.send_stage(address, migration_id, 0, 0, ids, src)
            await sink.done.wait()
            _sync(torch, args.device)
            times.append(time.perf_counter() - t0)
            assert all(torch.equal(d[:, lease], s[:, ids]) for s, d in zip(src_layers, dst_layers))
        row = {"tokens": length, "bytes": src.frame_bytes(n), "stage_ms": statistics.median(times) * 1e3}
        row["gbps"] = row["bytes"] / row["stage_ms"] / 1e6
        row["raw_tcp_gbps"] = statistics.median([await raw_loopback_gbps(row["bytes"]) for _ in range(3)])
        block = bytes(memoryview(bytearray(np.random.default_rng(0).bytes(16 << 20))))
        t0 = time.perf_counter()
        payload_crc32(block)  # the data plane's own CRC-32 (ISA-L's where the isal package is there)
        row["crc32_gbps"] = len(block) / (time.perf_counter() - t0) / 1e9
        rows.append(row)
        print(f"{length:>6} tok data plane (gather, CRC, TCP, scatter): {row['stage_ms']:8.2f} ms "
              f"({row['gbps']:5.2f} GB/s) | raw loopback TCP {row['raw_tcp_gbps']:5.2f} GB/s, "
              f"CRC-32 {row['crc32_gbps']:5.2f} GB/s", flush=True)
    senders.close()
    await receiver.close()
    src.close()
    dst.close()
    return rows


def measure_interference(torch, args, src_layers: list) -> dict:
    """Decode-like steps on the default stream: alone, beside the copier (side stream), and
    beside the same gather issued on the default stream."""
    rows_per_matrix = 8192
    count = max(1, int(args.weights_gib * 2**30 / (rows_per_matrix * rows_per_matrix * 2)))
    weights = [torch.randn(rows_per_matrix, rows_per_matrix, dtype=torch.float16, device="cuda") for _ in range(count)]
    x = torch.randn(args.batch, rows_per_matrix, dtype=torch.float16, device="cuda")

    def step() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = x
        for w in weights:
            y = torch.tanh(y @ w)
        end.record()
        end.synchronize()  # the engine reads its sampled tokens back every step
        return start.elapsed_time(end)

    def run_steps() -> list[float]:
        return [step() for _ in range(args.steps)]

    for _ in range(5):
        step()
    alone = run_steps()
    n = -(-4096 // args.block_size)
    rng = np.random.default_rng(args.seed + 1)
    copier = BlockCopier([KVRegion(t, 1) for t in src_layers])
    stop = threading.Event()
    gathers: list[float] = []

    def copy_loop(on_default_stream: bool) -> None:
        loop = asyncio.new_event_loop()
        pinned = torch.empty(copier.frame_bytes(n), dtype=torch.uint8, pin_memory=True)
        while not stop.is_set():
            ids = rng.choice(args.pool_blocks, size=n, replace=False).tolist()
            t0 = time.perf_counter()
            if on_default_stream:  # the same fused gather, without the side stream
                index = torch.tensor(ids, device="cuda")
                staging = torch.cat([t.index_select(1, index).reshape(-1) for t in src_layers])
                pinned.copy_(staging.view(torch.uint8), non_blocking=True)
                torch.cuda.current_stream().synchronize()
            else:
                loop.run_until_complete(copier.gather(ids, 0))
            gathers.append(time.perf_counter() - t0)
        loop.close()

    result = {"weights_gib": count * rows_per_matrix * rows_per_matrix * 2 / 2**30, "batch": args.batch,
              "steps": args.steps, "gather_tokens": 4096, "gather_bytes": copier.frame_bytes(n),
              "alone_median_ms": statistics.median(alone), "alone_p99_ms": _percentile(alone, 0.99)}
    for name, on_default in (("side_stream", False), ("default_stream", True)):
        stop.clear()
        gathers.clear()
        worker = threading.Thread(target=copy_loop, args=(on_default,))
        worker.start()
        time.sleep(0.2)
        beside = run_steps()
        stop.set()
        worker.join()
        result[f"{name}_median_ms"] = statistics.median(beside)
        result[f"{name}_p99_ms"] = _percentile(beside, 0.99)
        result[f"{name}_slowdown_median"] = result[f"{name}_median_ms"] / result["alone_median_ms"]
        result[f"{name}_gathers"] = len(gathers)
        result[f"{name}_gather_median_ms"] = statistics.median(gathers) * 1e3 if gathers else None
        print(f"step alone {result['alone_median_ms']:.2f} ms (P99 {result['alone_p99_ms']:.2f}) | beside "
              f"{name} gathers {result[f'{name}_median_ms']:.2f} ms (P99 {result[f'{name}_p99_ms']:.2f}), "
              f"x{result[f'{name}_slowdown_median']:.3f}; {len(gathers)} gathers of "
              f"{copier.frame_bytes(n) / 2**20:.0f} MiB, median {result[f'{name}_gather_median_ms']:.1f} ms",
              flush=True)
    copier.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024, 4096])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-blocks", type=int, default=1024, help="blocks per pool (two pools)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--weights-gib", type=float, default=12.0, help="weights one decode-like step reads")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/copier_cuda.json")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu to check the script")
    torch.manual_seed(args.seed)
    src_layers = make_pool(torch, args, args.device)
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}; {args.layers} layers x [2, {args.pool_blocks}, {args.block_size}, "
          f"{args.kv_heads}, {args.head_size}] fp16 per pool", flush=True)
    copies = asyncio.run(measure_copies(torch, args, args.device, src_layers, dst_layers))
    data_plane = asyncio.run(measure_data_plane(torch, args, src_layers, dst_layers))
    del dst_layers
    interference = measure_interference(torch, args, src_layers) if args.device == "cuda" else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "torch": torch.__version__, "args": vars(args),
                               "copies": copies, "data_plane": data_plane,
                               "interference": interference}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
