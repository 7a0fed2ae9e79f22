"""Admin REST of master and node, registry records, and KV event replay."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio
from yutu.protocol.kv_events import END_SEQ, BlockStored, decode_batch
from yutu.registry import Registry

from tests.store.conftest import Cluster


async def test_admin_endpoints_registry_and_event_replay(store_cluster: Cluster) -> None:
    master = store_cluster.master(kv_events_replay_port="0", kv_events_topic="store")
    node = store_cluster.node("n0", size="2MiB")
    client = await store_cluster.client()
    for key in ("00aa", "00bb", "00cc"):
        assert await client.put(key, b"v" * 100) is True

    assert master.get("/health").json() == {"status": "ok"}
    assert master.get("/ready").json() == {"ready": True}
    assert master.get("/info").json()["kind"] == "store-master"
    stats = master.get("/stats").json()
    # three objects and the client's reservation for its next put of that size
    assert (stats["capacity"], stats["used"], stats["objects"], stats["segments"]) == (2 << 20, 4 * 128, 3, 1)
    assert stats["reserved_puts"] == 1
    (segment,) = master.get("/segments").json()
    assert (segment["segment"], segment["node_id"], segment["allocations"], segment["fragmentation"]) == (
        "n0", "n0", 4, 0.0,
    )  # fmt: skip
    obj = master.get("/objects/00bb").json()
    assert obj["size"] == 100 and obj["replicas"] == [
        ["n0", "dram", 128, 100, "complete", segment["host_id"], "dram"]
    ]
    assert master.get("/objects/nope").status_code == 404
    metrics = master.get("/metrics").text
    for line in (
        "yutu_store_capacity 2.097152e+06",
        "yutu_store_objects 3.0",
        # the first put reserves, every put commits (and reserves the next)
        'yutu_store_ops_total{op="BatchReserve",outcome="ok"} 1.0',
        'yutu_store_op_latency_seconds_count{op="BatchPutCommit"} 3.0',
        "yutu_store_reserved_puts 1.0",
        "yutu_store_evicted_objects_total 0.0",
    ):
        assert line in metrics, line
    assert node.get("/segments").json()[0]["mounted"] is True
    assert node.get("/stats").json()["size"] == 2 << 20

    registry = Registry.from_url(store_cluster.redis_url, store_cluster.prefix)
    try:
        (m,) = await registry.list("store-master")
        (n,) = await registry.list("store-node")
    finally:
        await registry.close()
    assert set(m.endpoints) == {"rpc", "rpc_stream", "kv_events", "kv_events_replay", "admin"}
    assert n.meta == {"segment": "n0", "size": 2 << 20, "disk_capacity": 0} and "transfer" in n.endpoints

    # put_ends' events are published in one batch per write-behind window (settle.EVENTS_BEHIND_S),
    # the puts of a window in one BlockStored
    everything: list[tuple[int, list[bytes]]] = []
    for _ in range(100):
        everything = await _replay(m.endpoints["kv_events_replay"], 0)
        if sum(len(hashes) for _, hashes in everything) >= 3:
            break
        await asyncio.sleep(0.05)
    assert 1 <= master.get("/stats").json()["published_events"] <= 3
    assert [h for _, hashes in everything for h in hashes] == [
        bytes.fromhex(k) for k in ("00aa", "00bb", "00cc")
    ]
    assert [seq for seq, _ in everything] == list(range(len(everything)))  # no gaps
    last = everything[-1][0]
    assert await _replay(m.endpoints["kv_events_replay"], last) == everything[-1:]  # from a sequence on


async def _replay(endpoint: str, start: int) -> list[tuple[int, list[bytes]]]:
    """(sequence, block hashes) of every batch the master replays from ``start`` on."""
    req = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    req.connect(endpoint)
    try:
        await req.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            _, seq, payload = await req.recv_multipart()
            if seq == END_SEQ:
                return replayed
            hashes: list[bytes] = []
            for event in decode_batch(payload).events:
                assert isinstance(event, BlockStored)
                hashes += event.block_hashes
            replayed.append((int.from_bytes(seq, "big"), hashes))
    finally:
        req.close(linger=0)
