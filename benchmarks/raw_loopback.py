"""The like-for-like baseline of the migration benchmarks: a raw loopback TCP copy of a stage's bytes,
from the same event loop (the source's, its engine stepping) to a receiver that lives for the
whole run, one copy right before and one right after each migration; and the destination llumlet
process with such a receiver on its own event loop. Shared by migration_sim.py and migration_vllm.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path

from services.llumlet.service import Llumlet
from services.process_helpers import die_with_parent

REPO = Path(__file__).resolve().parents[1]


_SIZE = struct.Struct("!Q")  # each raw copy is announced by its length (the same receivers serve any size)


def _raw_receiver(conn) -> None:
    """Reads copies (length, then the bytes) into a touched buffer and answers each with one
    byte, for as long as the sender goes on."""
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    buf = memoryview(bytearray())
    while True:
        size = bytearray(_SIZE.size)
        if not _recv_into_exactly(peer, memoryview(size)):
            return
        (nbytes,) = _SIZE.unpack(size)
        if len(buf) < nbytes:
            buf = memoryview(bytearray(b"\x01" * nbytes))  # touched: the destination's KV pool is warm too
        if not _recv_into_exactly(peer, buf[:nbytes]):
            return
        peer.sendall(b"k")


def _recv_into_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class RawLoopback:
    """A raw loopback TCP copy of `nbytes`, measured the way a stage is: one copy at a time, sent
    from this process's event loop (the source llumlet's, its engine stepping beside it) to a
    receiver that lives for the whole run (as the destination llumlet's KV receiver does), both
    buffers warm. No framing, no checksum, no acks but the one at the end (and an 8-byte length
    before the bytes)."""

    def __init__(self, nbytes: int, port: int | None = None) -> None:
        self.nbytes, self.port = nbytes, port  # a port: a receiver that runs already (else one is started)
        self._proc: multiprocessing.Process | None = None
        self._sock: socket.socket | None = None
        self._payload = memoryview(bytearray(b"\x5a" * nbytes))

    async def start(self) -> None:
        port = self.port
        if port is None:
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            self._proc = ctx.Process(target=_raw_receiver, args=(child,), daemon=True)
            self._proc.start()
            port = await asyncio.to_thread(parent.recv)
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)
        await self.copy()  # the receiver's first copy is not measured (its buffer and socket ramp up)

    async def copy(self) -> float:
        """GB/s of one copy (until the receiver's answer)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        await loop.sock_sendall(self._sock, _SIZE.pack(self.nbytes))
        await loop.sock_sendall(self._sock, self._payload)
        if await loop.sock_recv(self._sock, 1) != b"k":
            raise RuntimeError("raw loopback receiver went away")
        return self.nbytes / (time.monotonic() - started) / 1e9

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._proc is not None:
            self._proc.join(5)


async def raw_links(nbytes: int, destination_port: int) -> dict[str, RawLoopback]:
    """Raw copies into the destination llumlet (its event loop, beside its engine: the KV
    receiver's conditions; the like-for-like baseline) and into a receiver process of its own
    (an idle one), started and warmed up."""
    links = {"in_destination": RawLoopback(nbytes, destination_port), "own_process": RawLoopback(nbytes)}
    for link in links.values():
        await link.start()
    return links


async def beside_raw_copies(links: dict[str, RawLoopback], migrate: Awaitable[dict]) -> dict:
    """Run one migration with a raw copy over each link right before and right after it (the
    same machine load, the same sender loop); its row gets `raw_loopback_gbps`: {link: [before,
    after]}."""
    before = {name: await link.copy() for name, link in links.items()}
    row = await migrate
    after = {name: await links[name].copy() for name in reversed(links)}
    row["raw_loopback_gbps"] = {name: [before[name], after[name]] for name in links}
    return row


def transfer_vs_raw(rows: list[dict]) -> dict:
    """Per link, each transfer (`first_stage_gbps`) against the raw copies right before and
    after it (their mean; the better of the two is the stricter reading): median, min, max."""
    def against(name: str) -> dict:
        ratios = [(r["first_stage_gbps"] or 0) / statistics.fmean(r["raw_loopback_gbps"][name]) for r in rows]
        strict = [(r["first_stage_gbps"] or 0) / max(r["raw_loopback_gbps"][name]) for r in rows]
        copies = [gbps for r in rows for gbps in r["raw_loopback_gbps"][name]]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "runs": ratios,
                "strict_median": statistics.median(strict),
                "raw_gbps": {"median": statistics.median(copies), "min": min(copies), "max": max(copies)}}

    return {name: against(name) for name in rows[0]["raw_loopback_gbps"]}


def print_transfer_vs_raw(ratios: dict) -> None:
    for name, ratio in ratios.items():
        raw = ratio["raw_gbps"]
        print(f"raw loopback into {name.replace('_', ' ')}: single copies median {raw['median']:.2f} "
              f"[{raw['min']:.2f}-{raw['max']:.2f}] GB/s; transfer over it, per migration: median "
              f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}] (against the better of its two raw "
              f"copies: {ratio['strict_median']:.2f})")


class _RawSink(asyncio.BufferedProtocol):
    """The raw receiver inside the destination llumlet: reads copies (length, then the bytes)
    into a warm buffer on the llumlet's own event loop (beside its engine, as the KV receiver
    is) and answers each with one byte. No framing, no checksum."""

    def __init__(self) -> None:
        self.size = bytearray(_SIZE.size)
        self.buffer = memoryview(bytearray())
        self.target = memoryview(self.size)
        self.got = 0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.target[self.got :]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got < len(self.target):
            return
        self.got = 0
        if self.target.obj is self.size:
            (nbytes,) = _SIZE.unpack(self.size)
            if len(self.buffer) < nbytes:
                self.buffer = memoryview(bytearray(b"\x01" * nbytes))  # touched, as the KV pool is
            self.target = self.buffer[:nbytes]
        else:
            self.target = memoryview(self.size)
            self.transport.write(b"k")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


class _DestinationWithRawSink:
    """The destination llumlet, plus a raw loopback receiver on its event loop (its port is
    written to `port_file`)."""

    def __init__(self, llumlet, port_file: Path) -> None:
        self.llumlet, self.port_file = llumlet, port_file
        self.server = None

    async def start(self) -> None:
        await self.llumlet.start()
        pool = getattr(self.llumlet.engine, "kv_pool", None)
        if pool is not None:  # the simulated engine's lazily mapped pool: touch it, as the source's (`warm_up`)
            resident = _rss_bytes()
            pool.data.fill(0)
            print(f"destination KV pool touched: RSS {resident / 2**20:.0f} -> {_rss_bytes() / 2**20:.0f} MiB", flush=True)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(_RawSink, "127.0.0.1", 0)
        self.port_file.write_text(str(self.server.sockets[0].getsockname()[1]))

    async def stop(self) -> None:
        self.server.close()
        await self.llumlet.stop()


def serve_destination(argv: list[str]) -> None:
    """`corral llumlet ARGV[1:]` (the same config, engine and runner) with a raw receiver beside
    it: argv[0] is the file that gets the raw receiver's port."""
    from services.cli import build_parser
    from services.llumlet.config import config_from_args
    from services.llumlet.engines import create_engine
    from services.runner import run, serve_until_signalled
    from shared.logs import setup_logging

    setup_logging("llumlet")  # as `corral llumlet` (migration_vllm reads the destination's timing lines)
    port_file = Path(argv[0])
    config = config_from_args(build_parser().parse_args(["llumlet", *argv[1:]]))
    llumlet = Llumlet(config, create_engine(config))
    run(serve_until_signalled(_DestinationWithRawSink(llumlet, port_file), wait=llumlet.wait_failed))


def launch_destination(llumlet_args: list[str], port_file: Path, log_path: Path,
                       env: dict[str, str] | None = None) -> subprocess.Popen:
    """A `corral llumlet LLUMLET_ARGS` process with a raw loopback receiver on its event loop
    (`serve_destination`); `raw_port` reads that receiver's port once it is up."""
    port_file.unlink(missing_ok=True)
    launcher = "import sys; from benchmarks.raw_loopback import serve_destination; serve_destination(sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", launcher, str(port_file), *llumlet_args], cwd=REPO,
                            stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env,
                            preexec_fn=die_with_parent)


def raw_port(port_file: Path) -> int:
    return int(port_file.read_text())
