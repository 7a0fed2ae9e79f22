"""Batch operations, zero-copy buffers, concurrency and a client-contributed segment."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from yutu.errors import ErrorKind, YutuError

from tests.store.conftest import Cluster


async def test_batches_and_zero_copy(store_cluster: Cluster) -> None:
    master = store_cluster.master()
    store_cluster.node("n0")
    store_cluster.node("n1")
    client = await store_cluster.client()
    blobs = {f"{i:032x}": os.urandom(16 << 10) for i in range(100)}
    assert await client.put_batch(blobs, replicas=2) == [True] * 100
    assert await client.put_batch(list(blobs.items())[:3]) == [False] * 3  # already stored
    keys = list(blobs)
    got = await client.get_batch([*keys, "missing"])
    assert got[:-1] == [blobs[k] for k in keys] and got[-1] is None
    assert await client.exists_batch([keys[0], "missing"]) == [True, False]
    ops = master.get("/metrics").text
    # one BatchPutStart / BatchPutEnd for the 100-key put, not 100 of each; the single-replica
    # put of three stored keys reserves and commits once (its reservations stay the client's)
    assert 'yutu_store_ops_total{op="BatchPutStart",outcome="ok"} 1.0' in ops
    assert 'yutu_store_ops_total{op="BatchPutEnd",outcome="ok"} 1.0' in ops
    assert 'yutu_store_ops_total{op="BatchReserve",outcome="ok"} 1.0' in ops
    assert 'yutu_store_ops_total{op="BatchPutCommit",outcome="ok"} 1.0' in ops

    # zero copy: put from and get into registered buffers
    src = client.register_buffer("src", 1 << 20)
    dst = client.register_buffer("dst", 1 << 20)
    arr = src.view_numpy()
    arr[:] = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
    assert await client.put_from_batch(["z0", "z1"], src, [0, 4096], [4096, 8192]) == [True, True]
    assert await client.get_into_batch(["z1", "nope", "z0"], dst, [0, 65536, 8192]) == [8192, None, 4096]
    out = dst.view_numpy()
    assert bytes(out[:8192]) == bytes(arr[4096 : 4096 + 8192])
    assert bytes(out[8192 : 8192 + 4096]) == bytes(arr[:4096])
    with pytest.raises(YutuError) as err:
        await client.get_into("z1", dst, offset=(1 << 20) - 100)  # does not fit: refused, nothing read
    assert err.value.kind is ErrorKind.INVALID_REQUEST
    for offset, length in ((1 << 20, 1), (0, 0), (-1, 10)):  # refused before the master allocates anything
        with pytest.raises(YutuError) as err:
            await client.put_from("bad", src, offset, length)
        assert err.value.kind is ErrorKind.INVALID_REQUEST
    assert master.get("/stats").json()["pending_puts"] == 0 and not await client.exists("bad")

    assert await client.remove_batch([keys[0], "missing"]) == [True, False]
    assert await client.get_batch([keys[0]]) == [None]


async def test_concurrent_writers_and_readers(store_cluster: Cluster) -> None:
    store_cluster.master()
    store_cluster.node("n0")
    store_cluster.node("n1")
    writers = [await store_cluster.client(), await store_cluster.client(transports=("tcp",))]
    reader = await store_cluster.client()
    payloads = {f"c{i}": os.urandom(1000 + 37 * i) for i in range(60)}

    async def write(client_index: int) -> None:
        for key, data in payloads.items():  # both writers put every key: exactly one write wins each
            await writers[client_index].put(key, data, replicas=2)

    async def read() -> int:
        hits = 0
        for _ in range(3):
            for key, data in payloads.items():
                value = (await reader.get_batch([key]))[0]
                if value is not None:
                    assert value == data
                    hits += 1
            await asyncio.sleep(0)
        return hits

    _, _, hits = await asyncio.gather(write(0), write(1), read())
    assert hits >= 0
    assert await reader.get_batch(list(payloads)) == list(payloads.values())
    upserted = os.urandom(5000)
    assert await writers[0].put("c0", upserted, upsert=True) is True
    assert await writers[1].get("c0") == upserted


async def test_client_contributes_its_own_segment(store_cluster: Cluster) -> None:
    master = store_cluster.master()
    owner = await store_cluster.client(segment_bytes=4 << 20)  # no store node at all
    other = await store_cluster.client(transports=("tcp",))
    payload = os.urandom(300_000)
    assert await other.put("k", payload) is True
    (replica,) = await other.replicas("k")
    assert replica.segment == owner.client_id
    assert await other.get("k") == payload
    segments = master.get("/segments").json()
    # the object and the writer's reservation for its next put of that size
    assert [(s["segment"], s["capacity"], s["used"]) for s in segments] == [
        (owner.client_id, 4 << 20, 2 * 300_032)
    ]
