"""Micro-benchmark of the transfer engine against the physical baselines, measured in the same run.

    .venv/bin/python loadtests/bench_transfer.py [--size-mib 4] [--iters 64] [--batch 16] [--repeat 5]

A peer engine runs in a child process (region of ``--size-mib * --batch`` bytes) next to a raw
socket server. The parent measures, each ``--repeat`` times (best run reported):

- raw TCP stream: the child ``sendall``s ``iters`` x size bytes, the parent ``recv_into``s them;
- engine TCP READ: ``iters`` single-request batches of ``size`` bytes, then batches of ``--batch``;
- numpy memcpy: ``np.copyto`` of ``size`` bytes between two warm arrays;
- engine SHM READ: as for TCP, with transports ("shm",).

Every series touches the same working set (``--batch`` chunks of ``size``, rotating), so baselines
and engine pay the same cache misses. The series are interleaved round by round; the report gives
medians of GB/s and of the per-round ratios engine/baseline. Starts its own redis-server unless
``--redis-url`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import redis.asyncio as aioredis
from yutu.launcher import free_port
from yutu.transfer import SegmentDirectory, TransferEngine, TransferOp, TransferRequest

MiB = 1 << 20


# ------------------------------------------------------------------------- child: peer + raw server


def raw_server(listener: socket.socket, size: int, chunks: int) -> None:
    """Per connection: read a u64 total, send that many bytes in ``size`` pieces rotating over a
    ``chunks * size`` buffer (the same memory footprint as the engine's region)."""
    buf = memoryview(bytearray(os.urandom(size)) * chunks)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                (total,) = struct.unpack("!Q", head)
                j = 0
                while total > 0:
                    n = min(total, size)
                    conn.sendall(buf[j * size : j * size + n])
                    total -= n
                    j = (j + 1) % chunks


async def serve_peer(args: argparse.Namespace) -> None:
    size = args.size_mib * MiB
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_server, args=(listener, size, args.batch), daemon=True).start()
    client = aioredis.Redis.from_url(args.redis_url)
    engine = TransferEngine("bench-peer", SegmentDirectory(client, prefix="bench"))
    region = engine.register_region("pool", size * args.batch)
    region.view_numpy()[:] = 7  # touch every page: measure copies, not first faults
    await engine.start()
    print(json.dumps({"raw_port": listener.getsockname()[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await engine.close()
    await client.aclose()


# ------------------------------------------------------------------------- parent: measurements


class RawClient:
    def __init__(self, port: int, size: int, chunks: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.size, self.chunks = size, chunks
        self.buf = memoryview(bytearray(size * chunks))
        self.buf[:] = b"\x01" * len(self.buf)

    def gbps(self, iters: int) -> float:
        """Stream ``iters * size`` bytes, received into rotating ``size`` chunks."""
        size, total = self.size, self.size * iters
        t0 = time.perf_counter()
        self.sock.sendall(struct.pack("!Q", total))
        for i in range(iters):
            j = i % self.chunks
            view, pos = self.buf[j * size : (j + 1) * size], 0
            while pos < size:
                n = self.sock.recv_into(view[pos:])
                if n == 0:
                    raise ConnectionError("raw server closed")
                pos += n
        return total / (time.perf_counter() - t0) / 1e9


def memcpy_gbps(src: np.ndarray, dst: np.ndarray, size: int, iters: int, chunks: int) -> float:
    """``iters`` copies of ``size`` bytes, rotating over ``chunks`` chunks (1 = cache-hot)."""
    t0 = time.perf_counter()
    for i in range(iters):
        j = (i % chunks) * size
        np.copyto(dst[j : j + size], src[j : j + size])
    return size * iters / (time.perf_counter() - t0) / 1e9


async def engine_gbps(engine: TransferEngine, size: int, iters: int, per_batch: int, chunks: int) -> float:
    """``iters`` READs of ``size`` bytes, ``per_batch`` requests per batch, rotating over ``chunks``."""
    reqs = [
        TransferRequest(TransferOp.READ, "buf", j * size, "bench-peer", "pool", j * size, size)
        for j in range(chunks)
    ]
    batches = [
        [reqs[(b * per_batch + k) % chunks] for k in range(per_batch)]
        for b in range(max(1, iters // per_batch))
    ]
    t0 = time.perf_counter()
    for batch in batches:
        results = await engine.transfer(batch)
        if not all(r.ok for r in results):
            raise RuntimeError(f"transfer failed: {[r.error for r in results if not r.ok][0]}")
    return size * per_batch * len(batches) / (time.perf_counter() - t0) / 1e9


async def measure(args: argparse.Namespace, raw_port: int) -> dict[str, list[float]]:
    size, chunks, iters = args.size_mib * MiB, args.batch, args.iters
    client = aioredis.Redis.from_url(args.redis_url)
    directory = SegmentDirectory(client, prefix="bench")
    loop = asyncio.get_running_loop()
    raw = RawClient(raw_port, size, chunks)
    src = np.full(size * chunks, 3, dtype=np.uint8)
    dst = np.ones(size * chunks, dtype=np.uint8)
    engines = {}
    for transport in ("tcp", "shm"):
        engine = TransferEngine(
            f"bench-{transport}",
            directory,
            tcp_connections=args.connections,
            transports=(transport,),
            tcp_slice_bytes=args.slice_kib * 1024,
        )
        engine.register_region("buf", size * chunks).view_numpy()[:] = 1
        await engine.start()
        await engine_gbps(engine, size, chunks, chunks, chunks)  # warm: connections, mappings, pages
        engines[transport] = engine
    out: dict[str, list[float]] = {}
    for _ in range(args.repeat):  # interleaved, so drift and neighbours hit every series alike
        sample = {
            "raw_tcp": await loop.run_in_executor(None, raw.gbps, iters),
            "tcp_single": await engine_gbps(engines["tcp"], size, iters, 1, chunks),
            "tcp_batch": await engine_gbps(engines["tcp"], size, iters, args.batch, chunks),
            "memcpy": memcpy_gbps(src, dst, size, iters, chunks),
            "memcpy_hot": memcpy_gbps(src, dst, size, iters, 1),
            "shm_single": await engine_gbps(engines["shm"], size, iters, 1, chunks),
            "shm_batch": await engine_gbps(engines["shm"], size, iters, args.batch, chunks),
        }
        for key, value in sample.items():
            out.setdefault(key, []).append(value)
        for key in ("tcp_single", "tcp_batch"):
            out.setdefault(key + "/raw", []).append(sample[key] / sample["raw_tcp"])
        for key in ("shm_single", "shm_batch"):
            out.setdefault(key + "/memcpy", []).append(sample[key] / sample["memcpy"])
    for engine in engines.values():
        await engine.close()
    raw.sock.close()
    await client.aclose()
    return out


def report(args: argparse.Namespace, r: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in r.items()}
    print(
        f"{args.size_mib} MiB READs, {args.iters} per series, working set {args.batch} x {args.size_mib} MiB, "
        f"median of {args.repeat} interleaved rounds"
    )
    print(f"  raw TCP stream (sendall/recv_into)  {med['raw_tcp']:6.2f} GB/s")
    print(
        f"  engine TCP, 1 request per batch     {med['tcp_single']:6.2f} GB/s  {med['tcp_single/raw']:4.0%} of raw"
    )
    print(
        f"  engine TCP, {args.batch:2d} requests per batch   {med['tcp_batch']:6.2f} GB/s  {med['tcp_batch/raw']:4.0%} of raw"
    )
    print(
        f"  numpy memcpy (same working set)     {med['memcpy']:6.2f} GB/s   (cache-hot 4 MiB: {med['memcpy_hot']:.2f})"
    )
    print(
        f"  engine SHM, 1 request per batch     {med['shm_single']:6.2f} GB/s  {med['shm_single/memcpy']:4.0%} of memcpy"
    )
    print(
        f"  engine SHM, {args.batch:2d} requests per batch   {med['shm_batch']:6.2f} GB/s  {med['shm_batch/memcpy']:4.0%} of memcpy"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=4)
    parser.add_argument("--iters", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--connections", type=int, default=4, help="tcp_connections of the engine")
    parser.add_argument("--slice-kib", type=int, default=2048, help="tcp_slice_bytes of the engine, in KiB")
    parser.add_argument("--serve-peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_peer:
        asyncio.run(serve_peer(args))
        return
    redis_proc = None
    if args.redis_url is None:
        port = free_port()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        redis_proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        args.redis_url = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.3)
    child_args = [sys.executable, __file__, "--serve-peer", "--redis-url", args.redis_url]
    child_args += ["--size-mib", str(args.size_mib), "--batch", str(args.batch)]
    peer = subprocess.Popen(child_args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None and peer.stdin is not None
        raw_port = json.loads(peer.stdout.readline())["raw_port"]
        report(args, asyncio.run(measure(args, raw_port)))
        peer.stdin.write("\n")
        peer.stdin.flush()
        peer.wait(timeout=10)
    finally:
        if peer.poll() is None:
            peer.kill()
        if redis_proc is not None:
            redis_proc.terminate()


if __name__ == "__main__":
    main()
