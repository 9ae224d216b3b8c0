"""What TLS would cost the KV data plane: bytes through a loopback TCP connection into a
preallocated buffer, as the KV receiver takes them (an asyncio BufferedProtocol reading straight
into its target: kv_connection.py), in clear and over TLS (Python's ssl, AES-GCM, a fresh
self-signed certificate), each side a process of its own.

    .venv/bin/python -m benchmarks.kv_tls_cost [--gib 2] [--frame-mib 4] [--out results/kv_tls_cost.json]

Prints, for each, the throughput and the CPU seconds per GB each side spent (the rate the KV
data plane gets is bounded by CPU per byte where cores are shared with the engines). A stand-in
for the real transport, not the transport: it has no frames, checksums or acks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.process_helpers import die_with_parent

MIB = 1 << 20


class _Sink(asyncio.BufferedProtocol):
    """Reads into one preallocated buffer, over and over, until `total` bytes have come."""

    def __init__(self, total: int, done: asyncio.Future[None]) -> None:
        self.buffer = memoryview(bytearray(16 * MIB))
        self.left = total
        self.done = done

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left <= 0 and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed early"))


async def _receive(port_file: Path, total: int, tls: ssl.SSLContext | None) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    server = await loop.create_server(lambda: _Sink(total, done), "127.0.0.1", 0, ssl=tls)
    port_file.write_text(str(server.sockets[0].getsockname()[1]))
    await done
    server.close()


def _receiver(port_file: str, total: int, cert: str | None, key: str | None) -> None:
    tls = None
    if cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
    cpu = time.process_time()
    asyncio.run(_receive(Path(port_file), total, tls))
    print(json.dumps({"receiver_cpu_s": time.process_time() - cpu}))


async def _send(port: int, total: int, frame: int, cert: str | None) -> None:
    payload = os.urandom(frame)
    loop = asyncio.get_running_loop()
    if cert is None:  # as kv_sender: a non-blocking socket and loop.sock_sendall
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        for _ in range(total // frame):
            await loop.sock_sendall(sock, payload)
        sock.close()
        return
    tls = ssl.create_default_context(cafile=cert)
    tls.check_hostname = False
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    for _ in range(total // frame):
        writer.write(payload)
        await writer.drain()
    writer.close()


def measure(total: int, frame: int, home: Path, tls: bool) -> dict[str, float]:
    cert = key = None
    if tls:
        cert, key = str(home / "cert.pem"), str(home / "key.pem")
    port_file = home / f"port-{tls}"
    port_file.unlink(missing_ok=True)
    receiver = subprocess.Popen([sys.executable, "-m", "benchmarks.kv_tls_cost", "--receive", str(port_file),
                                 "--bytes", str(total)] + (["--cert", cert, "--key", key] if tls else []),  # type: ignore[list-item]
                                stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    while not port_file.exists() or not port_file.read_text():
        time.sleep(0.01)
    started, cpu = time.perf_counter(), time.process_time()
    asyncio.run(_send(int(port_file.read_text()), total, frame, cert))
    sender_cpu = time.process_time() - cpu
    out, _ = receiver.communicate(timeout=600)
    seconds = time.perf_counter() - started
    gb = total / 1e9
    return {"tls": tls, "gb": gb, "seconds": seconds, "gb_per_s": gb / seconds,
            "sender_cpu_s_per_gb": sender_cpu / gb, "receiver_cpu_s_per_gb": json.loads(out)["receiver_cpu_s"] / gb}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="bytes sent per mode")
    parser.add_argument("--frame-mib", type=int, default=4, help="bytes per write")
    parser.add_argument("--out", default="results/kv_tls_cost.json", help="(results/ is git-ignored)")
    parser.add_argument("--receive", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        _receiver(args.receive, args.bytes, args.cert, args.key)
        return 0
    frame = args.frame_mib * MIB
    total = int(args.gib * (1 << 30)) // frame * frame
    with tempfile.TemporaryDirectory(prefix="corral-kv-tls-") as tmp:
        home = Path(tmp)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kv",
                        "-keyout", str(home / "key.pem"), "-out", str(home / "cert.pem")],
                       check=True, capture_output=True)
        rows = [measure(total, frame, home, tls) for tls in (False, True)]
    print(f"{'transport':10s} {'GB/s':>6} {'sender CPU-s/GB':>16} {'receiver CPU-s/GB':>18}")
    for row in rows:
        print(f"{'TLS' if row['tls'] else 'clear':10s} {row['gb_per_s']:6.2f} {row['sender_cpu_s_per_gb']:16.2f} "
              f"{row['receiver_cpu_s_per_gb']:18.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"frame_bytes": frame, "runs": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
