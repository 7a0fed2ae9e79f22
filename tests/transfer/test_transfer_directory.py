"""The Redis segment directory: publish with TTL, keepalive, cache, invalidation, ownership."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable

import pytest
from yutu.transfer import (
    RegionDescriptor,
    SegmentConflictError,
    SegmentDescriptor,
    SegmentDirectory,
    SegmentNotFoundError,
    TransferEngine,
    TransportUnavailableError,
)
from yutu.transfer.segment import local_host_id, local_pid_namespace


def make_desc(
    name: str, incarnation: int = 1, pid: int = 1, regions: dict[str, int] | None = None
) -> SegmentDescriptor:
    return SegmentDescriptor(
        name=name,
        incarnation=incarnation,
        pid=pid,
        hostname="h",
        host_id=local_host_id(),
        pid_namespace=local_pid_namespace(),
        tcp_host="127.0.0.1",
        tcp_port=1,
        transports=("tcp",),
        regions={k: RegionDescriptor(v, f"/dev/shm/{k}", 1) for k, v in (regions or {}).items()},
    )


async def test_publish_lookup_ttl_and_withdraw(directory: SegmentDirectory) -> None:
    desc = make_desc("a", regions={"pool": 4096})
    await directory.publish(desc)
    assert await directory.lookup("a") == desc
    ttl_ms = await directory.redis.pttl(directory.key("a"))
    assert 0 < ttl_ms <= directory.ttl_s * 1000
    assert await directory.names() == ["a"]
    # withdraw only deletes our own incarnation's entry
    await directory.withdraw(make_desc("a", incarnation=2))
    assert await directory.redis.exists(directory.key("a")) == 1
    await directory.withdraw(desc)
    assert await directory.redis.exists(directory.key("a")) == 0
    with pytest.raises(SegmentNotFoundError, match="segment not found"):
        await directory.lookup("a")


async def test_lookup_is_cached_until_invalidated(directory: SegmentDirectory) -> None:
    old = make_desc("b", incarnation=1)
    await directory.publish(old)
    await directory.redis.set(directory.key("b"), make_desc("b", incarnation=2).to_json())  # behind our back
    assert (await directory.lookup("b")).incarnation == 1  # cached
    assert (await directory.lookup("b", fresh=True)).incarnation == 2
    await directory.redis.set(directory.key("b"), make_desc("b", incarnation=3).to_json())
    directory.invalidate("b")
    assert (await directory.lookup("b")).incarnation == 3


async def test_entry_expires_without_keepalive(transfer_redis_url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(transfer_redis_url)
    directory = SegmentDirectory(client, prefix=prefix, ttl_s=0.3, cache_ttl_s=0)
    try:
        await directory.publish(make_desc("c"))
        await asyncio.sleep(0.5)
        with pytest.raises(SegmentNotFoundError):
            await directory.lookup("c")
    finally:
        await client.aclose()


async def test_engine_keeps_its_entry_alive_and_withdraws_on_close(
    transfer_redis_url: str, prefix: str
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(transfer_redis_url)
    directory = SegmentDirectory(client, prefix=prefix, ttl_s=0.3, cache_ttl_s=0)
    try:
        engine = TransferEngine("live", directory)
        async with engine:
            engine.register_region("pool", 4096)
            await engine.publish()
            await asyncio.sleep(0.8)  # > 2 TTLs: only the keepalive keeps it there
            desc = await directory.lookup("live")
            assert desc.pid == engine.descriptor().pid
            assert desc.regions["pool"].size == 4096
            assert desc.transports == ("shm", "tcp")
            assert desc.tcp_port == engine.endpoint[1]  # type: ignore[index]
        with pytest.raises(SegmentNotFoundError):
            await directory.lookup("live")
    finally:
        await client.aclose()


async def test_name_conflicts_with_a_live_engine_but_not_a_dead_one(
    directory: SegmentDirectory, make_engine: Callable[..., TransferEngine]
) -> None:
    first = make_engine("dup")
    await first.start()
    with pytest.raises(SegmentConflictError, match="already published by pid"):
        await make_engine("dup").start()
    # An entry left by a process that died on this host is taken over.
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await child.wait()
    stale = make_desc("ghost", incarnation=5, pid=child.pid)
    await directory.publish(stale)
    ghost = make_engine("ghost")
    await ghost.start()
    assert (await directory.lookup("ghost", fresh=True)).incarnation == ghost.descriptor().incarnation


async def test_engine_rejects_rdma_and_bad_arguments(directory: SegmentDirectory) -> None:
    with pytest.raises(TransportUnavailableError, match="rdma"):
        TransferEngine("x", directory, transports=("rdma", "tcp"))
    with pytest.raises(ValueError, match="segment_name"):
        TransferEngine("", directory)
    with pytest.raises(ValueError, match="timeout"):
        TransferEngine("x", directory, default_timeout_s=0)


async def test_malformed_entry_is_reported(directory: SegmentDirectory) -> None:
    await directory.redis.set(directory.key("bad"), json.dumps({"v": 1, "name": "bad"}))
    with pytest.raises(ValueError, match="malformed"):
        await directory.lookup("bad")
