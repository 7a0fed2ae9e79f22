"""Eviction, leases, pins, abandoned puts and KV events, through the running services."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import zmq
import zmq.asyncio
from yutu.protocol import store as p
from yutu.protocol.kv_events import BlockRemoved, BlockStored, decode_batch
from yutu.registry import Registry
from yutu.rpc import RpcClient

from tests.store.conftest import Cluster

SLOT = 64 << 10


async def _master_endpoints(cluster: Cluster) -> dict[str, str]:
    registry = Registry.from_url(cluster.redis_url, cluster.prefix)
    try:
        (record,) = await registry.list("store-master")
        return record.endpoints
    finally:
        await registry.close()


async def test_eviction_order_and_protected_objects(store_cluster: Cluster) -> None:
    master = store_cluster.master(lease_ttl="30", soft_pin_ttl="30")
    store_cluster.node("n0", size="1MiB")  # 16 slots of 64 KiB
    endpoints = await _master_endpoints(store_cluster)
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoints["kv_events"])
    await asyncio.sleep(0.3)  # let the subscription reach the publisher
    rpc = RpcClient(p.CHANNEL, endpoints["rpc"])
    client = await store_cluster.client(reserve_bytes=0)  # exact space: no reservations held
    data = {f"k{i:02d}": os.urandom(SLOT) for i in range(15)}
    try:
        await client.put("k00", data["k00"], soft_pin=True)  # pinned
        await client.put("k01", data["k01"])
        assert await client.get("k01") == data["k01"]  # leased for 30 s, and oldest after k00
        await client.put_batch([(f"k{i:02d}", data[f"k{i:02d}"]) for i in range(2, 14)])  # 14 slots: 87.5 %
        upsert = await rpc.call(p.PutStart("k02", SLOT, upsert=True))  # k02 "being written", never ended
        assert upsert.put_id is not None  # 15 slots: past the 90 % watermark -> evict 5 %: k03
        assert [o["protection"] for o in (master.get(f"/objects/k0{i}").json() for i in range(3))] == [
            "pinned", "leased", "writing",
        ]  # fmt: skip
        await client.put("k14", data["k14"])  # lands in k03's hole; 15 slots again -> evicts k04
        big = os.urandom(2 * SLOT)
        await client.put("big", big)  # no 128 KiB hole: evicts k05, k06 (LRU), then fits at 256 KiB
        assert [r.offset for r in await client.replicas("big")] == [4 * SLOT]
        present = await client.exists_batch([f"k{i:02d}" for i in range(15)])
        assert [k for k, ok in zip(data, present, strict=True) if not ok] == ["k03", "k04", "k05", "k06"]
        assert await client.get("k02") == data["k02"]  # the unfinished upsert left the old bytes readable
        assert await client.get("big") == big
        stats = master.get("/stats").json()
        assert stats["evicted_objects"] == 4 and stats["used"] == 14 * SLOT
        assert stats["objects"] == 12 and stats["pending_puts"] == 1

        stored: list[bytes] = []
        removed: list[list[bytes]] = []
        seqs: list[int] = []
        while await sub.poll(200):
            topic, seq, payload = await sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            for event in decode_batch(payload).events:
                if isinstance(event, BlockStored):
                    stored += event.block_hashes
                elif isinstance(event, BlockRemoved):
                    removed.append(list(event.block_hashes))
        assert seqs == list(range(len(seqs)))
        assert stored == [f"k{i:02d}".encode() for i in range(14)] + [b"k14", b"big"]
        assert removed == [[b"k03"], [b"k04"], [b"k05", b"k06"]]
    finally:
        await rpc.close()
        sub.close(linger=0)


async def test_lease_expiry_and_abandoned_put(store_cluster: Cluster) -> None:
    master = store_cluster.master()  # lease 1 s, put timeout 3 s
    store_cluster.node("n0", size="1MiB")
    client = await store_cluster.client(reserve_bytes=0)  # exact space: no reservations held
    endpoints = await _master_endpoints(store_cluster)
    rpc = RpcClient(p.CHANNEL, endpoints["rpc"])
    try:
        await client.put("leased", os.urandom(1000))
        await client.replicas("leased")  # takes a read lease
        assert await client.remove("leased") is True
        stats = master.get("/stats").json()
        assert stats["objects"] == 0 and stats["used"] == 1024 and stats["retired_extents"] == 1
        store_cluster.wait_for(lambda: master.get("/stats").json()["used"] == 0, 5, "the lease to expire")

        started = time.monotonic()
        reply = await rpc.call(p.PutStart("orphan", 5000, writer="a writer that vanishes"))
        assert reply.put_id is not None and master.get("/stats").json()["pending_puts"] == 1
        store_cluster.wait_for(
            lambda: master.get("/stats").json()["pending_puts"] == 0, 8, "the put to be reclaimed"
        )
        assert time.monotonic() - started >= 2.9
        stats = master.get("/stats").json()
        assert stats["used"] == 0 and stats["reclaimed_puts"] == 1
        late = await rpc.call(p.BatchPutEnd(["orphan"], [reply.put_id]))
        assert late.results[0][0][0] == "not_found_error"
    finally:
        await rpc.close()


async def test_eviction_policy_option_lfu_keeps_the_frequently_read(store_cluster: Cluster) -> None:
    master = store_cluster.master(eviction_policy="lfu")
    store_cluster.node("n0", size="1MiB")  # 16 slots of 64 KiB
    client = await store_cluster.client(reserve_bytes=0)  # exact space: no reservations held
    keys = [f"k{i:02d}" for i in range(14)]
    await client.put_batch([(k, bytes([i]) * SLOT) for i, k in enumerate(keys)])  # 87.5 %
    await client.get("k00")
    await client.get("k00")  # k00 read first and most: LRU's first victim, LFU's last
    assert [len(v) for v in await client.get_batch(keys[1:])] == [SLOT] * 13
    store_cluster.wait_for(
        lambda: all(master.get(f"/objects/{k}").json()["protection"] is None for k in keys),
        10,
        "leases to end",
    )
    await client.put("k14", b"x" * SLOT)  # 15 slots: past the 90 % watermark -> evicts 5 %: one object
    present = await client.exists_batch(keys)
    assert [k for k, ok in zip(keys, present, strict=True) if not ok] == ["k01"]
    stats = master.get("/stats").json()
    assert stats["eviction_policy"] == "lfu" and stats["evicted_objects"] == 1


def test_an_unknown_eviction_policy_stops_the_master(store_cluster: Cluster) -> None:
    with pytest.raises(AssertionError, match="invalid choice: 'fifo'"):
        store_cluster.master(eviction_policy="fifo")
