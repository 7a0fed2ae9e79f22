"""Objects from 1 byte to 64 MiB through real store processes, byte for byte, over SHM and TCP."""

from __future__ import annotations

import os

import numpy as np
import pytest
from yutu.errors import ErrorKind, YutuError

from tests.store.conftest import Cluster

SIZES = [1, 63, 64, 65, 4096, (64 << 10) + 3, 1 << 20, (4 << 20) - 1, 64 << 20]


@pytest.mark.parametrize("transports", [("shm", "tcp"), ("tcp",)], ids=["shm", "tcp"])
async def test_round_trip_1_byte_to_64_mib(store_cluster: Cluster, transports: tuple[str, ...]) -> None:
    store_cluster.master()
    store_cluster.node("n0", size="80MiB")
    store_cluster.node("n1", size="80MiB")
    client = await store_cluster.client(transports=transports)
    for size in SIZES:
        payload = os.urandom(size)
        key = f"obj-{size}"
        assert await client.put(key, payload, replicas=2) is True
        assert await client.put(key, b"other bytes") is False  # idempotent: the first bytes stay
        assert await client.get(key) == payload
        replicas = await client.replicas(key)
        assert sorted(r.segment for r in replicas) == ["n0", "n1"]
        assert all(r.length == size and r.state == "complete" for r in replicas)
        assert await client.remove(key) is True  # keep the 80 MiB segments free for the next size
    with pytest.raises(YutuError) as err:
        await client.get("obj-1")
    assert err.value.kind is ErrorKind.NOT_FOUND


async def test_buffers_of_any_kind_and_remove_all(store_cluster: Cluster) -> None:
    store_cluster.master()
    store_cluster.node("n0")
    client = await store_cluster.client()
    array = np.arange(1000, dtype=np.float32)  # (1000,) float32 = 4000 bytes
    assert await client.put("np", array) is True
    assert await client.put("mv", memoryview(bytearray(b"abc"))) is True
    assert np.frombuffer(await client.get("np"), dtype=np.float32).tolist() == array.tolist()
    with pytest.raises(YutuError) as err:
        await client.put("empty", b"")
    assert err.value.kind is ErrorKind.INVALID_REQUEST
    with pytest.raises(ValueError):
        await client.put("strided", array[::2])  # not contiguous: refused before anything is sent
    assert await client.remove_all() == 2
    assert await client.exists_batch(["np", "mv"]) == [False, False]
