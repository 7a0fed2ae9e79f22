"""Group commit of the master's metadata: background commits coalesce with acknowledged ones; the
write itself against a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from yutu.errors import YutuError
from yutu.launcher import free_port

from services.store_master import persistence
from services.store_master.persistence import MetadataStore, Persister


class FakeStore:
    """Records every write as ``(objects, segments)``, each taking ``write_s``; fails while
    ``fail`` is set."""

    def __init__(self) -> None:
        self.writes: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.fail = False
        self.write_s = 0.001

    async def write(self, objects: dict[str, Any], segments: dict[str, Any]) -> None:
        await asyncio.sleep(self.write_s)
        if self.fail:
            raise RedisConnectionError("redis is down")
        self.writes.append((objects, segments))


def make(values: dict[str, bytes]) -> tuple[Persister, FakeStore]:
    store = FakeStore()
    return Persister(store, values.get, lambda name: None), store  # type: ignore[arg-type]


async def test_background_commit_is_absorbed_by_a_commit_made_before_it_fires() -> None:
    values = {"a": b"pending"}
    persister, store = make(values)
    persister.mark({"a"}, set())
    persister.commit_soon(0.05)  # put_start: not waited for
    values["a"] = b"complete"
    persister.mark({"a"}, set())
    await persister.commit()  # put_end: waited for, writes the current value
    assert store.writes == [({"a": b"complete"}, {})]
    await asyncio.sleep(0.1)
    assert store.writes == [({"a": b"complete"}, {})]  # the timer found nothing left to write


async def test_background_commit_writes_after_its_delay() -> None:
    persister, store = make({"a": b"pending", "b": b"other"})
    persister.mark({"a"}, set())
    persister.commit_soon(0.02)
    persister.mark({"b"}, set())
    persister.commit_soon(0.02)  # one timer at a time; it writes every mark made by then
    assert store.writes == []
    await asyncio.sleep(0.1)
    assert store.writes == [({"a": b"pending", "b": b"other"}, {})]
    assert not persister.dirty


async def test_failed_background_commit_keeps_the_marks_for_the_next_commit() -> None:
    persister, store = make({"a": b"v"})
    store.fail = True
    persister.mark({"a"}, set())
    persister.commit_soon(0.0)
    await asyncio.sleep(0.05)
    assert store.writes == [] and persister.dirty
    with pytest.raises(YutuError, match="could not be saved to Redis"):
        await persister.commit()
    store.fail = False
    persister.mark(set(), set())
    await persister.commit()
    assert store.writes == [({"a": b"v"}, {})]
    await persister.close()


async def test_a_sooner_background_commit_brings_the_pending_one_forward() -> None:
    """A put_end written behind (WRITE_BEHIND_S) after a put_start's background commit (50 ms):
    the write happens at the sooner deadline, once, with every mark made by then."""
    persister, store = make({"a": b"pending", "b": b"complete"})
    persister.mark({"a"}, set())
    persister.commit_soon(10.0)
    persister.mark({"b"}, set())
    persister.commit_soon(0.01)
    persister.commit_soon(5.0)  # a later deadline never delays the pending one
    await asyncio.sleep(0.2)
    assert store.writes == [({"a": b"pending", "b": b"complete"}, {})]
    await persister.close()
    assert store.writes == [({"a": b"pending", "b": b"complete"}, {})]


async def test_a_failed_background_commit_is_tried_again_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts written behind while Redis is down reach it once it is back, with no other operation."""
    monkeypatch.setattr(persistence, "RETRY_S", 0.05)
    persister, store = make({"a": b"v"})
    store.fail = True
    persister.mark({"a"}, set())
    persister.commit_soon(0.0)
    await asyncio.sleep(0.03)
    assert store.writes == [] and persister.dirty
    store.fail = False
    for _ in range(100):
        if store.writes:
            break
        await asyncio.sleep(0.02)
    assert store.writes == [({"a": b"v"}, {})] and not persister.dirty
    await persister.close()


async def test_marks_made_during_a_background_write_wait_for_their_own_delay() -> None:
    """A stream of puts written behind: the puts finished while a write is in flight go in the
    next window's write, not in a write chained right after it (which made one write per put or
    two under load)."""
    persister, store = make({"a": b"1", "b": b"2"})
    store.write_s = 0.1
    persister.mark({"a"}, set())
    persister.commit_soon(0.0)
    await asyncio.sleep(0.02)  # a's write is in flight
    persister.mark({"b"}, set())
    persister.commit_soon(0.3)
    await asyncio.sleep(0.2)  # a's write ended ~0.1 s ago; b is not due before ~0.32 s
    assert store.writes == [({"a": b"1"}, {})]
    await asyncio.sleep(0.4)
    assert store.writes == [({"a": b"1"}, {}), ({"b": b"2"}, {})] and not persister.dirty
    await persister.close()


async def test_a_background_commit_due_during_a_write_follows_it() -> None:
    persister, store = make({"a": b"1", "b": b"2"})
    store.write_s = 0.1
    persister.mark({"a"}, set())
    persister.commit_soon(0.0)
    await asyncio.sleep(0.02)
    persister.mark({"b"}, set())
    persister.commit_soon(0.01)  # due while a's write is still in flight
    for _ in range(50):
        if len(store.writes) == 2:
            break
        await asyncio.sleep(0.02)
    assert store.writes == [({"a": b"1"}, {}), ({"b": b"2"}, {})] and not persister.dirty
    await persister.close()


# -- MetadataStore.write against a real Redis ---------------------------------------------------


RECORDS = {"obj-1": b"\x93\x01\x02\x03", "obj-\u00e9": b"\x00" * 40, "obj-3": b"x"}


async def test_a_write_sets_and_deletes_what_redis_py_commands_would(
    redis_url: str, registry_prefix: str
) -> None:
    """The held connection's write (hiredis-packed commands, one send) against the plain client's
    HSET and HDEL of the same records (the reference), deletes and both hashes included."""
    client = aioredis.from_url(redis_url)
    ours, plain = MetadataStore(client, f"{registry_prefix}-a"), MetadataStore(client, f"{registry_prefix}-b")
    try:
        await ours.write(RECORDS, {"seg-0": b"S"})
        await client.hset(plain.objects_key, mapping=RECORDS)  # type: ignore[arg-type]
        await client.hset(plain.segments_key, mapping={"seg-0": b"S"})  # type: ignore[arg-type]
        await ours.write({"obj-1": None, "obj-3": b"y", "obj-none": None}, {})
        await client.hdel(plain.objects_key, "obj-1", "obj-none")
        await client.hset(plain.objects_key, "obj-3", b"y")
        for key in ("objects_key", "segments_key"):
            assert await client.hgetall(getattr(ours, key)) == await client.hgetall(getattr(plain, key))
        assert await client.hgetall(ours.objects_key) == {"obj-\u00e9".encode(): b"\x00" * 40, b"obj-3": b"y"}
    finally:
        await client.delete(ours.objects_key, ours.segments_key, plain.objects_key, plain.segments_key)
        await client.aclose()


async def test_a_write_whose_connection_was_dropped_goes_again(redis_url: str, registry_prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    store = MetadataStore(client, registry_prefix)
    try:
        await store.write({"a": b"1"}, {})
        killer = aioredis.from_url(redis_url)
        assert await killer.execute_command("CLIENT", "KILL", "TYPE", "normal") >= 1  # all but itself
        await killer.aclose()
        await store.write({"b": b"2"}, {})
        assert await client.hgetall(store.objects_key) == {b"a": b"1", b"b": b"2"}
    finally:
        await client.delete(store.objects_key)
        await client.aclose()
    away = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(RedisConnectionError):
        await MetadataStore(away, registry_prefix).write({"a": b"1"}, {})
    await away.aclose()
