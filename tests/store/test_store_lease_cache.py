"""The client's lease cache: repeated gets skip the master only while the read lease protects the bytes."""

from __future__ import annotations

import asyncio
import os
import re

import pytest
from yutu.errors import ErrorKind, YutuError

from tests.store.conftest import Cluster, Proc


def located(master: Proc) -> float:
    """How many BatchGetReplicas RPCs the master has answered."""
    text = master.get("/metrics").text
    found = re.search(r'^yutu_store_ops_total\{op="BatchGetReplicas",outcome="ok"\} (\S+)$', text, re.M)
    return 0.0 if found is None else float(found.group(1))


async def test_cached_gets_skip_the_master_while_the_lease_protects_the_bytes(store_cluster: Cluster) -> None:
    master = store_cluster.master(lease_ttl="1.5")
    store_cluster.node("n0", size="2MiB")
    cached = await store_cluster.client(lease_cache=True, lease_cache_margin_s=0.5)
    other = await store_cluster.client()
    value = os.urandom(200_000)
    assert await other.put("k", value) is True

    assert await cached.get("k") == value  # cold: asks the master, takes a lease
    asked = located(master)
    assert [await cached.get("k") for _ in range(5)] == [value] * 5  # warm: no RPC
    assert located(master) == asked

    # another client removes it and puts objects of the same size: were k's extent freed, the
    # best-fit allocator would hand it to the first of them; leased, it is retired instead
    assert await other.remove("k") is True
    assert store_cluster.stats(master)["retired_extents"] == 1
    fillers = {f"f{i}": os.urandom(200_000) for i in range(4)}
    assert await other.put_batch(fillers) == [True] * 4
    assert await cached.get("k") == value  # still the object as leased: bounded staleness, never garbage

    await asyncio.sleep(1.1)  # the cached entry ends 0.5 s before the 1.5 s lease
    with pytest.raises(YutuError) as err:
        await cached.get("k")
    assert err.value.kind is ErrorKind.NOT_FOUND and located(master) == asked + 1
    store_cluster.wait_for(lambda: store_cluster.stats(master)["retired_extents"] == 0, 5, "the lease to end")
    assert await other.get_batch(list(fillers)) == list(fillers.values())


async def test_own_removes_and_puts_drop_cached_entries_at_once(store_cluster: Cluster) -> None:
    master = store_cluster.master(lease_ttl="5.0")
    store_cluster.node("n0", size="1MiB")
    cached = await store_cluster.client(lease_cache=True)
    assert await cached.put("a", b"one" * 100) is True
    assert await cached.get("a") == b"one" * 100
    assert await cached.put("a", b"two" * 100, upsert=True) is True
    assert await cached.get("a") == b"two" * 100  # the upsert dropped the entry: asked the master again
    assert await cached.remove("a") is True
    with pytest.raises(YutuError) as err:
        await cached.get("a")
    assert err.value.kind is ErrorKind.NOT_FOUND
    assert await cached.put("b", b"x" * 64) is True
    await cached.get("b")
    asked = located(master)
    assert await cached.remove_batch(["b"]) == [True]
    assert await cached.get_batch(["b"]) == [None] and located(master) == asked + 1


async def test_without_the_cache_every_get_asks_the_master(store_cluster: Cluster) -> None:
    master = store_cluster.master()
    store_cluster.node("n0", size="1MiB")
    plain = await store_cluster.client()
    other = await store_cluster.client()
    assert await other.put("k", b"v" * 1000) is True
    before = located(master)
    assert [await plain.get("k") for _ in range(3)] == [b"v" * 1000] * 3
    assert located(master) == before + 3
    assert await other.remove("k") is True
    with pytest.raises(YutuError) as err:
        await plain.get("k")
    assert err.value.kind is ErrorKind.NOT_FOUND
