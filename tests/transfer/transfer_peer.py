"""A TransferEngine in its own process, for the transfer tests (see transfer_helpers.PeerProcess).

stdin commands, one per line; one reply line each on stdout:
    digest <region> <offset> <length>   -> DIGEST <sha256 hex of those bytes>
    fill <region> <seed>                -> OK   (refill the whole region with pattern(seed))
    quit                                -> BYE  (close the engine and exit)
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis
from transfer_helpers import digest, pattern
from yutu.transfer import SegmentDirectory, TransferEngine


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--segment", required=True)
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--region", action="append", default=[], help="name:size:seed")
    args = parser.parse_args()
    client = aioredis.Redis.from_url(args.redis_url)
    directory = SegmentDirectory(client, prefix=args.prefix, ttl_s=args.ttl)
    engine = TransferEngine(args.segment, directory, transports=tuple(args.transports.split(",")))
    for spec in args.region:
        name, size, seed = spec.split(":")
        region = engine.register_region(name, int(size))
        region.view_numpy()[:] = pattern(int(seed), int(size))
    await engine.start()
    endpoint = engine.endpoint
    print(f"READY {endpoint[1] if endpoint else 0}", flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd, *rest = line.split()
            try:
                if cmd == "digest":
                    name, offset, length = rest[0], int(rest[1]), int(rest[2])
                    view = engine.regions[name].view_numpy(offset, length)
                    print(f"DIGEST {digest(view)}", flush=True)
                elif cmd == "fill":
                    region = engine.regions[rest[0]]
                    region.view_numpy()[:] = pattern(int(rest[1]), region.size)
                    print("OK", flush=True)
                elif cmd == "quit":
                    break
                else:
                    print(f"ERROR unknown command {cmd!r}", flush=True)
            except Exception as exc:
                print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
    finally:
        await engine.close()
        await client.aclose()
    print("BYE", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
