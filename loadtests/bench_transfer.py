"""Micro-benchmark of the transfer engine against the physical baselines, measured in the same run.

    .venv/bin/python loadtests/bench_transfer.py [--size-mib 4] [--iters 64] [--batch 16] [--repeat 5]

A peer engine runs in a child process (region of ``--size-mib * --batch`` bytes) next to a raw
socket server. The parent measures, each ``--repeat`` times (best run reported):

- raw TCP stream: the child ``sendall``s ``iters`` x size bytes, the parent ``recv_into`` one buffer;
- engine TCP READ: ``iters`` single-request batches of ``size`` bytes, then batches of ``--batch``;
- numpy memcpy: ``np.copyto`` of ``size`` bytes between two warm arrays;
- engine SHM READ: as for TCP, with transports ("shm",).

Prints GB/s and the ratios engine/baseline. Starts its own redis-server unless ``--redis-url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import numpy as np
import redis.asyncio as aioredis
from yutu.transfer import SegmentDirectory, TransferEngine, TransferOp, TransferRequest

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------- child: peer + raw server


def raw_server(listener: socket.socket, size: int) -> None:
    """Per connection: read a u64 total, send that many bytes from one ``size`` buffer."""
    buf = memoryview(bytearray(os.urandom(size)))
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                (total,) = struct.unpack("!Q", head)
                while total > 0:
                    n = min(total, size)
                    conn.sendall(buf[:n])
                    total -= n


async def serve_peer(args: argparse.Namespace) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_server, args=(listener, args.size_mib * MiB), daemon=True).start()
    client = aioredis.Redis.from_url(args.redis_url)
    engine = TransferEngine("bench-peer", SegmentDirectory(client, prefix="bench"))
    region = engine.register_region("pool", args.size_mib * MiB * args.batch)
    region.view_numpy()[:] = 7  # touch every page: measure copies, not first faults
    await engine.start()
    print(json.dumps({"raw_port": listener.getsockname()[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await engine.close()
    await client.aclose()


# ------------------------------------------------------------------------- parent: measurements


def raw_tcp_gbps(port: int, size: int, iters: int) -> float:
    buf = memoryview(bytearray(size))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        total = size * iters
        t0 = time.perf_counter()
        s.sendall(struct.pack("!Q", total))
        got = 0
        while got < total:
            n = s.recv_into(buf[: min(size, total - got)])
            if n == 0:
                raise ConnectionError("raw server closed")
            got += n
        return total / (time.perf_counter() - t0) / 1e9


def memcpy_gbps(size: int, iters: int) -> float:
    src = np.full(size, 3, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(iters):
        np.copyto(dst, src)
    return size * iters / (time.perf_counter() - t0) / 1e9


async def engine_gbps(engine: TransferEngine, size: int, iters: int, batch: int) -> float:
    """Move ``iters * size`` bytes with READs in batches of ``batch`` requests of ``size`` bytes."""
    reqs = [
        TransferRequest(TransferOp.READ, "buf", j * size, "bench-peer", "pool", j * size, size)
        for j in range(batch)
    ]
    rounds = max(1, iters // batch)
    await engine.transfer(reqs)  # warm up: connections, mappings, pages
    t0 = time.perf_counter()
    for _ in range(rounds):
        results = await engine.transfer(reqs)
        bad = [r for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"transfer failed: {bad[0]}")
    return size * batch * rounds / (time.perf_counter() - t0) / 1e9


async def best(repeat: int, fn: Callable[[], Awaitable[float]]) -> float:
    return max([await fn() for _ in range(repeat)])


async def measure(args: argparse.Namespace, raw_port: int) -> dict[str, float]:
    size = args.size_mib * MiB
    client = aioredis.Redis.from_url(args.redis_url)
    directory = SegmentDirectory(client, prefix="bench")
    out: dict[str, float] = {}
    loop = asyncio.get_running_loop()

    async def raw() -> float:
        return await loop.run_in_executor(None, raw_tcp_gbps, raw_port, size, args.iters)

    async def memcpy() -> float:
        return memcpy_gbps(size, args.iters)

    out["raw_tcp"] = await best(args.repeat, raw)
    out["memcpy"] = await best(args.repeat, memcpy)
    for transport in ("tcp", "shm"):
        engine = TransferEngine(f"bench-{transport}", directory, transports=(transport,))
        engine.register_region("buf", size * args.batch).view_numpy()[:] = 0
        async with engine:
            out[f"{transport}_single"] = await best(
                args.repeat, lambda e=engine: engine_gbps(e, size, args.iters, 1)
            )
            out[f"{transport}_batch"] = await best(
                args.repeat, lambda e=engine: engine_gbps(e, size, args.iters, args.batch)
            )
    await client.aclose()
    return out


def report(args: argparse.Namespace, r: dict[str, float]) -> None:
    print(f"size {args.size_mib} MiB, {args.iters} per run, batch {args.batch}, best of {args.repeat} (GB/s)")
    print(f"  raw TCP stream (sendall/recv_into) {r['raw_tcp']:6.2f}")
    print(
        f"  engine TCP READ, 1 per batch       {r['tcp_single']:6.2f}  = {r['tcp_single'] / r['raw_tcp']:4.0%} of raw"
    )
    print(
        f"  engine TCP READ, {args.batch:2d} per batch      {r['tcp_batch']:6.2f}  = {r['tcp_batch'] / r['raw_tcp']:4.0%} of raw"
    )
    print(f"  numpy memcpy                       {r['memcpy']:6.2f}")
    print(
        f"  engine SHM READ, 1 per batch       {r['shm_single']:6.2f}  = {r['shm_single'] / r['memcpy']:4.0%} of memcpy"
    )
    print(
        f"  engine SHM READ, {args.batch:2d} per batch      {r['shm_batch']:6.2f}  = {r['shm_batch'] / r['memcpy']:4.0%} of memcpy"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=4)
    parser.add_argument("--iters", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--redis-url", default=None)
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
