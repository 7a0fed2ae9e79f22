"""yutu.redis_conn's clients: commands packed by hiredis are byte for byte redis-py's, and work
against a real Redis (pipelines too)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from yutu.redis_conn import HiredisPacking, connect

SHAPES: list[tuple[Any, ...]] = [
    ("PING",),
    ("HSET", "yutu:store:objects", *(x for i in range(80) for x in (f"key-{i:04d}", os.urandom(90)))),
    ("SET", "k", b"v", "PX", 1500),
    ("SET", "k", -5), ("SET", "k", 2**70), ("SET", "k", 0),
    ("SET", "ключ", "значение ✓"),
    ("SET", "k", 1.5),  # floats: redis-py's repr (the reference)
    ("SET", "k", b"x" * 10_000),  # longer than the cutoff: redis-py sends it unjoined
    ("SET", "k", memoryview(b"abc")), ("SET", "k", bytearray(b"ab")),
    ("CONFIG GET", "maxmemory"), (b"CLIENT SETNAME", b"yutu"),
    ("EVALSHA", "abc", 1, "key", b"\x00\xff"),
]  # fmt: skip


class _Packed(HiredisPacking, Connection):
    pass


@pytest.mark.parametrize("args", SHAPES, ids=lambda a: f"{a[0]}-{len(a)}")
def test_hiredis_packs_what_redis_py_packs(args: tuple[Any, ...]) -> None:
    reference = b"".join(bytes(part) for part in Connection().pack_command(*args))
    assert b"".join(bytes(part) for part in _Packed().pack_command(*args)) == reference


def test_the_write_behind_hset_takes_the_c_packer() -> None:
    hset = SHAPES[1]
    assert len(_Packed().pack_command(*hset)) == 1  # one buffer from hiredis
    assert len(Connection().pack_command(*hset)) > 1  # redis-py's chunks


def test_refusals_are_redis_pys() -> None:
    for bad in (True, None, object()):
        with pytest.raises(Exception) as ours:
            _Packed().pack_command("SET", "k", bad)
        with pytest.raises(Exception) as theirs:
            Connection().pack_command("SET", "k", bad)
        assert type(ours.value) is type(theirs.value)


def test_every_connection_kind_packs_with_hiredis() -> None:
    for url, base in (
        ("redis://127.0.0.1:1/0", Connection),
        ("unix:///tmp/nowhere.sock", UnixDomainSocketConnection),
    ):
        cls = connect(url).connection_pool.connection_class
        assert issubclass(cls, HiredisPacking) and issubclass(cls, base)


async def test_commands_and_pipelines_round_trip(redis_url: str) -> None:
    client = connect(redis_url)
    try:
        records = {f"rc-key-{i}".encode(): os.urandom(90) for i in range(80)}
        assert await client.hset("rc:objects", mapping=records) == 80  # type: ignore[misc]
        assert await client.hgetall("rc:objects") == records  # type: ignore[misc]
        async with client.pipeline(transaction=False) as pipe:
            pipe.set("rc:a", "ключ", px=60_000).incrby("rc:n", 2**40).hdel("rc:objects", *records)
            assert await pipe.execute() == [True, 2**40, 80]
        assert await client.get("rc:a") == "ключ".encode()
    finally:
        await client.delete("rc:a", "rc:n", "rc:objects")
        await client.aclose()
