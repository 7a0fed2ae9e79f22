"""The master's metadata survives Redis: a restart of an append-only Redis keeps it, and a Redis that
comes back empty (flushed, restarted without its data) gets all of it written again."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgpack
import pytest
import redis
import redis.asyncio as aioredis
from yutu.launcher import ProcessGroup, free_port, start_redis

from services.store_master.persistence import MetadataStore, Persister
from services.store_master.resync import MetadataWatch
from tests.store.conftest import Cluster, stop_cluster


class OwnRedis:
    """A redis-server with an append-only file in ``data_dir``, for tests that kill it."""

    def __init__(self, data_dir: Path) -> None:
        self.url = f"redis://127.0.0.1:{free_port()}/0"
        self.data_dir = data_dir
        self.group = ProcessGroup()

    def start(self) -> None:
        start_redis(self.group, self.url, self.data_dir, persist=True)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync."""
        for child in self.group.children:
            child.proc.kill()
            child.proc.wait()
        self.group.children.clear()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def sync_aof(self) -> None:
        """Make everything written so far durable: rewrite the append-only file and wait for it."""
        with self.client() as client:
            before = int(client.info("persistence")["aof_rewrites"])
            client.bgrewriteaof()
            deadline = time.monotonic() + 20
            while True:
                info = client.info("persistence")
                if int(info["aof_rewrites"]) > before and not int(info["aof_rewrite_in_progress"]):
                    assert info["aof_last_bgrewrite_status"] == "ok"
                    return
                assert time.monotonic() < deadline, "the AOF rewrite did not finish"
                time.sleep(0.05)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.group.stop()


@pytest.fixture
async def cluster(own_redis: OwnRedis, registry_prefix: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    """Like ``store_cluster``, on the test's own Redis."""
    cluster = Cluster(own_redis.url, registry_prefix, tmp_path)
    try:
        yield cluster
    finally:
        await stop_cluster(cluster)


def stored(server: OwnRedis, prefix: str) -> tuple[set[str], set[str]]:
    """(object keys, segment names) the master's records in Redis hold."""
    with server.client() as client:
        objects = {k.decode() for k in client.hkeys(f"{prefix}:store:objects")}
        segments = {k.decode() for k in client.hkeys(f"{prefix}:store:segments")}
    return objects, segments


def written_behind(server: OwnRedis, cluster: Cluster, objects: set[str]) -> None:
    """A put_end that released nothing is in Redis within WRITE_BEHIND_S, with no other operation
    to push it (generous timeout: the machine is slow and shared)."""
    cluster.wait_for(lambda: stored(server, cluster.prefix) == (objects, {"n0"}), timeout=5.0,
                     what="the put_ends written behind to reach Redis")  # fmt: skip


PAYLOADS = {f"durable-{i}": os.urandom(10_000 + i) for i in range(5)}


async def test_metadata_survives_a_sigkilled_append_only_redis_and_a_master_restart(
    own_redis: OwnRedis, cluster: Cluster
) -> None:
    master = cluster.master()
    cluster.node("n0", size="8MiB")
    store = await cluster.client()
    assert await store.put_batch(PAYLOADS) == [True] * len(PAYLOADS)
    written_behind(own_redis, cluster, set(PAYLOADS))
    own_redis.sync_aof()
    own_redis.kill()
    own_redis.start()  # the same data directory: the append-only file is reloaded
    assert stored(own_redis, cluster.prefix) == (set(PAYLOADS), {"n0"})
    # The master's pooled connections all died with the old Redis; its next write still succeeds.
    # (A fresh client: this test is about the master; a client's own pool is its own business.)
    store = await cluster.client()
    assert await store.put("after-restart", b"x" * 1000)
    written_behind(own_redis, cluster, {*PAYLOADS, "after-restart"})
    master.stop()
    master = cluster.restart(master)  # recovers from the restarted Redis alone
    assert "recovered 1 segments and 6 objects from Redis" in master.log.read_text()
    assert await store.get_batch(list(PAYLOADS)) == list(PAYLOADS.values())
    assert cluster.stats(master)["metadata_rewrites"] == 0  # nothing was lost: nothing rewritten


async def test_an_emptied_redis_gets_the_whole_state_written_again_within_seconds(
    own_redis: OwnRedis, cluster: Cluster
) -> None:
    master = cluster.master()
    cluster.node("n0", size="8MiB")
    store = await cluster.client()
    assert await store.put_batch(PAYLOADS) == [True] * len(PAYLOADS)
    with own_redis.client() as client:
        client.flushall()
    cluster.wait_for(
        lambda: stored(own_redis, cluster.prefix) == (set(PAYLOADS), {"n0"}),
        timeout=5.0,
        what="the master to write its segments and objects again",
    )
    log = master.log.read_text()
    assert "Redis lost the store metadata" in log and "writing 1 segments and 5 objects again" in log
    assert cluster.stats(master)["metadata_rewrites"] == 1
    master.stop()
    master = cluster.restart(master)
    assert "recovered 1 segments and 5 objects from Redis" in master.log.read_text()
    # The flush took the node's transfer-directory entry too: its engine publishes it again
    # within a third of its TTL (that is the engine's business, not the master's).
    with own_redis.client() as client:
        cluster.wait_for(lambda: client.exists(f"{cluster.prefix}:segment:n0"), what="n0 republished")
    assert await store.get_batch(list(PAYLOADS)) == list(PAYLOADS.values())


async def test_watch_rewrites_once_per_loss_and_flushes_marks_a_failed_write_left(
    redis_url: str, registry_prefix: str
) -> None:
    client = aioredis.from_url(redis_url)
    values = {"obj-a": b"A", "obj-b": b"B"}
    segments = {"seg-0": b"S"}
    store = MetadataStore(client, registry_prefix)
    persister = Persister(store, values.get, segments.get)
    watch = MetadataWatch(client, registry_prefix, persister, lambda: (set(values), set(segments)), "t")
    try:
        await watch.arm()
        assert await watch.check() is False  # armed, nothing lost
        assert await client.hlen(store.objects_key) == 0  # and nothing written behind our back
        await client.delete(watch.key)  # what a FLUSHALL does to it
        assert await watch.check() is True
        assert await client.hgetall(store.objects_key) == {b"obj-a": b"A", b"obj-b": b"B"}
        assert await client.hgetall(store.segments_key) == {b"seg-0": b"S"}
        assert await watch.check() is False and watch.rewrites == 1
        values["obj-c"] = b"C"
        persister.mark({"obj-c"}, set())  # as if its commit had failed: the marks stay
        assert persister.dirty
        assert await watch.check() is False
        assert not persister.dirty and await client.hget(store.objects_key, "obj-c") == b"C"
    finally:
        await client.delete(watch.key, store.objects_key, store.segments_key)
        await client.aclose()


def record(server: OwnRedis, prefix: str, key: str) -> list[object] | None:
    """Object ``key``'s record in Redis (ObjectEntry.to_wire()), None when there is none."""
    with server.client() as client:
        raw = client.hget(f"{prefix}:store:objects", key)
    return None if raw is None else msgpack.unpackb(raw, raw=False)


async def test_an_upsert_is_in_redis_before_its_put_answers(own_redis: OwnRedis, cluster: Cluster) -> None:
    """An upsert gives the old replicas' space back: its record is committed before the reply (so
    no later object can take that space while Redis still names it), not written behind."""
    cluster.master()
    cluster.node("n0", size="8MiB")
    store = await cluster.client()
    assert await store.put("up", b"a" * 3000)
    written_behind(own_redis, cluster, {"up"})
    before = record(own_redis, cluster.prefix, "up")
    assert await store.put("up", b"b" * 5000, upsert=True)
    after = record(own_redis, cluster.prefix, "up")  # read at once: no waiting
    assert before is not None and after is not None and after != before
    assert (before[0], after[0]) == (3000, 5000)  # [size, replicas, ...]: the new generation
    assert after[3] is None  # no put pending any more
    assert await store.get("up") == b"b" * 5000


async def test_a_sigkilled_master_loses_at_most_its_last_puts_and_never_serves_wrong_bytes(
    own_redis: OwnRedis, cluster: Cluster
) -> None:
    """Puts acknowledged just before a SIGKILL may be unknown to the restarted master (written
    behind, services.store_master.settle); every key it does know reads back exactly, the older
    puts are all there, and the space of the lost ones is given to new puts."""
    master = cluster.master()
    cluster.node("n0", size="8MiB")
    store = await cluster.client()
    old = {f"old-{i}": os.urandom(20_000 + i) for i in range(10)}
    assert await store.put_batch(old) == [True] * len(old)
    written_behind(own_redis, cluster, set(old))
    recent = {f"recent-{i}": os.urandom(30_000 + i) for i in range(40)}
    for key, value in recent.items():
        assert await store.put(key, value)
    master.kill()
    master = cluster.restart(master)
    got = await store.get_batch([*old, *recent])
    assert got[: len(old)] == list(old.values())
    for value, want in zip(got[len(old) :], recent.values(), strict=True):
        assert value is None or value == want
    assert "recovered 1 segments and" in master.log.read_text()
    # the lost puts' space is free again: fill the segment past it, every object reads back exactly
    fresh = {f"fresh-{i}": os.urandom(100_000) for i in range(30)}
    assert await store.put_batch(fresh) == [True] * len(fresh)
    assert await store.get_batch(list(fresh)) == list(fresh.values())
    assert (await store.get_batch(list(old)))[: len(old)] == list(old.values())
