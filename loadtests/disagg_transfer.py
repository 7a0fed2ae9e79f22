"""The transfer engine alone, moving what a handoff moves: a prompt's KV blocks between two processes.

    raw = measure_pulls(redis_url, block_bytes, [32, 64, 128], repeat=15)
    raw["shm_contiguous"][128]["p50_ms"]

A peer process (this file with ``--serve``) registers a region of ``max(blocks)`` KV blocks in a
transfer engine; this process READs from it with :func:`yutu.worker.kv_io.pull_blocks`, the call a
decode instance makes to pull a prefill's hold, in three shapes per block count:

- ``shm_contiguous``: shared memory, the blocks adjacent on both sides (one request, as between
  two fresh workers: what the stack on one host does);
- ``shm_per_block``: shared memory, adjacent on neither side (one request per block: the worst
  case of fragmented caches);
- ``tcp_contiguous``: one request over TCP (what two hosts would use), for reference;
- ``tcp_per_block``: over TCP, adjacent on neither side (the ranges travel as vector requests,
  READV: up to 2 MiB of blocks per exchange, ``yutu.transfer.tcp_wire``).

Rounds interleave the shapes, so drift and neighbours hit each alike; every page is touched before
timing. Segments live under their own registry prefix, so they never meet the stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from yutu.transfer import SegmentDirectory, TransferEngine
from yutu.worker.kv_io import pull_blocks

PREFIX = "yutu-bench-transfer"
PEER = "bench-peer"
REGION = "kv"
SHAPES = ("shm_contiguous", "shm_per_block", "tcp_contiguous", "tcp_per_block")


async def serve(redis_url: str, size: int) -> None:
    """The peer: a touched region of ``size`` bytes, served until stdin closes or sends a line."""
    client = aioredis.Redis.from_url(redis_url)
    engine = TransferEngine(PEER, SegmentDirectory(client, prefix=PREFIX))
    try:
        engine.register_region(REGION, size).view_numpy()[:] = 7
        await engine.start()
        print(json.dumps({"ready": True}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    finally:
        await engine.close()
        await client.aclose()


def pairs_of(shape: str, blocks: int) -> list[tuple[int, int]]:
    """(local block, remote block) pairs: runs of one on both sides for ``per_block``."""
    if shape.endswith("per_block"):
        return [(i, blocks - 1 - i) for i in range(blocks)]
    return [(i, i) for i in range(blocks)]


async def _time_pull(engine: TransferEngine, shape: str, blocks: int, block_bytes: int) -> float:
    started = time.perf_counter()
    got = await pull_blocks(engine, REGION, PEER, REGION, pairs_of(shape, blocks), block_bytes, 10.0)
    elapsed = time.perf_counter() - started
    if got != blocks:
        raise RuntimeError(f"{shape}: pulled {got} of {blocks} blocks (see the log above)")
    return elapsed


async def _measure(redis_url: str, block_bytes: int, counts: Sequence[int], repeat: int) -> dict[str, Any]:
    client = aioredis.Redis.from_url(redis_url)
    directory = SegmentDirectory(client, prefix=PREFIX)
    engines = {
        "shm": TransferEngine("bench-shm", directory, transports=("shm",)),
        "tcp": TransferEngine("bench-tcp", directory, transports=("tcp",)),
    }
    samples: dict[str, dict[int, list[float]]] = {s: {n: [] for n in counts} for s in SHAPES}
    try:
        for engine in engines.values():
            engine.register_region(REGION, max(counts) * block_bytes).view_numpy()[:] = 1
            await engine.start()
        for shape in SHAPES:  # warm: connections, mappings
            await _time_pull(engines[shape[:3]], shape, max(counts), block_bytes)
        for _ in range(repeat):
            for n in counts:
                for shape in SHAPES:
                    samples[shape][n].append(await _time_pull(engines[shape[:3]], shape, n, block_bytes))
    finally:
        for engine in engines.values():
            await engine.close()
        await client.aclose()
    return {
        shape: {
            n: {
                "bytes": n * block_bytes,
                "p50_ms": statistics.median(xs) * 1e3,
                "min_ms": min(xs) * 1e3,
                "gbps": n * block_bytes / statistics.median(xs) / 1e9,
            }
            for n, xs in by_count.items()
        }
        for shape, by_count in samples.items()
    }


def measure_pulls(redis_url: str, block_bytes: int, counts: Sequence[int], repeat: int) -> dict[str, Any]:
    """Per shape (``SHAPES``) and block count: median and best time of one pull, its bytes and GB/s.

    Starts the peer process and always stops it; ``RuntimeError`` when a pull comes back short.
    """
    size = max(counts) * block_bytes
    peer = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--redis-url", redis_url, "--bytes", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdin is not None and peer.stdout is not None
        line = peer.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"the transfer peer did not start (exit code {peer.poll()})")
        return asyncio.run(_measure(redis_url, block_bytes, counts, repeat))
    finally:
        if peer.stdin is not None:
            peer.stdin.close()  # the peer's readline returns: it closes its engine
        try:
            peer.wait(timeout=15)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
        if peer.stdout is not None:
            peer.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--bytes", type=int, help="region size (with --serve)")
    parser.add_argument("--serve", action="store_true", help="run the peer (used by measure_pulls)")
    parser.add_argument("--block-bytes", type=int, default=32768)
    parser.add_argument("--blocks", default="32,64,128", help="block counts, comma separated")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.redis_url, args.bytes))
        return
    counts = [int(c) for c in args.blocks.split(",")]
    print(json.dumps(measure_pulls(args.redis_url, args.block_bytes, counts, args.repeat), indent=2))


if __name__ == "__main__":
    main()
