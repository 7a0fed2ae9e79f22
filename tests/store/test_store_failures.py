"""Failures: a node SIGKILLed during reads, a master restarted, malformed RPCs, out-of-range transfers."""

from __future__ import annotations

import asyncio
import os
import time

import msgpack
import pytest
import redis
import zmq
import zmq.asyncio
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.registry import Registry
from yutu.rpc import RpcClient
from yutu.transfer import TransferOp, TransferRequest, TransferStatus

from tests.store.conftest import Cluster


async def _rpc_endpoint(cluster: Cluster, name: str = "rpc") -> str:
    """The newest master's ZeroMQ endpoint (``rpc_stream``: its stream one)."""
    registry = Registry.from_url(cluster.redis_url, cluster.prefix)
    try:
        records = await registry.list("store-master")
        return max(records, key=lambda r: r.started_at).endpoints[name]
    finally:
        await registry.close()


def _in_redis(cluster: Cluster, key: str) -> bool:
    """Whether the master's record of ``key`` reached Redis (a put_end is written behind)."""
    with redis.Redis.from_url(cluster.redis_url) as r:
        return bool(r.hexists(f"{cluster.prefix}:store:objects", key))


async def test_node_killed_during_reads(store_cluster: Cluster) -> None:
    master = store_cluster.master()  # node TTL 1.5 s
    n0 = store_cluster.node("n0")
    store_cluster.node("n1")
    client = await store_cluster.client(transports=("tcp",))
    both = {f"both{i}": os.urandom(200_000) for i in range(8)}
    assert await client.put_batch(both, replicas=2) == [True] * 8
    only0 = os.urandom(10_000)
    assert await client.put("only0", only0) is True
    if [r.segment for r in await client.replicas("only0")] != ["n0"]:
        await client.remove("only0")  # placement is by free space: make sure the lone copy is on n0
        await client.put("filler", os.urandom(300_000))
        assert await client.put("only0", only0) is True
        assert [r.segment for r in await client.replicas("only0")] == ["n0"]

    stop = asyncio.Event()
    reads = {"ok": 0, "failed_cleanly": 0}

    async def reader() -> None:
        while not stop.is_set():
            for key, data in both.items():  # every read succeeds: n1 serves when n0 is gone
                assert await client.get(key) == data
                reads["ok"] += 1
            try:
                assert await client.get("only0") == only0
            except YutuError as exc:  # the lone copy is gone: a clear error, never a hang or bad bytes
                assert exc.kind in (ErrorKind.UNAVAILABLE, ErrorKind.NOT_FOUND)
                reads["failed_cleanly"] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.3)
    killed_at = time.monotonic()
    n0.kill()
    await asyncio.to_thread(
        store_cluster.wait_for, lambda: master.get("/stats").json()["segments"] == 1, 10, "n0 to be dropped"
    )
    assert time.monotonic() - killed_at >= 1.5 - 0.3  # not before its TTL (minus one heartbeat interval)
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(task, 20)
    assert reads["ok"] > 16 and reads["failed_cleanly"] > 0
    for key in both:
        assert [r.segment for r in await client.replicas(key)] == ["n1"]
    with pytest.raises(YutuError) as err:
        await client.get("only0")
    assert err.value.kind is ErrorKind.NOT_FOUND
    assert master.get("/stats").json()["lost_objects"] == 1


async def test_master_restart_recovers_metadata(store_cluster: Cluster) -> None:
    master = store_cluster.master(node_ttl="5")
    store_cluster.node("n0")
    store_cluster.node("n1")
    client = await store_cluster.client()
    blobs = {f"r{i}": os.urandom(50_000 + i) for i in range(20)}
    assert await client.put_batch(blobs, replicas=2) == [True] * 20
    before = master.get("/segments").json()
    store_cluster.wait_for(
        lambda: all(_in_redis(store_cluster, k) for k in blobs), 5, "the puts written behind"
    )
    master.kill()  # no goodbye: everything the next master knows comes from Redis
    master = store_cluster.restart(master)
    after = master.get("/segments").json()
    assert [(s["segment"], s["used"], s["allocations"]) for s in after] == [
        (s["segment"], s["used"], s["allocations"]) for s in before
    ]
    assert await client.get_batch(list(blobs)) == list(blobs.values())
    assert await client.put("after-restart", b"x" * 777) is True
    assert await client.get("after-restart") == b"x" * 777
    await asyncio.sleep(1.0)  # nodes keep heartbeating the new master: nothing is dropped
    assert master.get("/stats").json()["objects"] == 21


async def test_malformed_rpcs_are_refused_and_change_nothing(store_cluster: Cluster) -> None:
    master = store_cluster.master()
    store_cluster.node("n0")
    client = await store_cluster.client()
    await client.put("keep", b"12345")
    endpoint = await _rpc_endpoint(store_cluster)
    before = master.get("/segments").json()
    rpc = RpcClient(p.CHANNEL, endpoint, timeout_s=5.0)
    bad_calls = [
        p.PutStart("k", -1),
        p.PutStart("k", "12"),  # type: ignore[arg-type]
        p.PutStart("", 10),
        p.PutStart(["k"], 10),  # type: ignore[arg-type]
        p.PutStart("k" * 600, 10),
        p.PutStart("k", 10, replicas=0),
        p.PutEnd("keep", "forged-put-id"),
        p.BatchPutStart(["a", "b"], [1]),
        p.BatchGetReplicas("not-a-list"),  # type: ignore[arg-type]
        p.MountSegment("n", "s", "r", -5, "h", 1),
        p.UnmountSegment("intruder", "n0"),
        p.UnmountSegment("n0", ["n0"]),  # type: ignore[arg-type]
    ]
    try:
        for msg in bad_calls:
            with pytest.raises(YutuError) as err:
                await rpc.call(msg)
            assert err.value.kind in (ErrorKind.INVALID_REQUEST, ErrorKind.NOT_FOUND), (msg, err.value)
            assert str(err.value)
        # a batch refuses the bad item alone, in its outcome
        reply = await rpc.call(p.BatchUnmountSegment("n0", [["n0"]]))  # type: ignore[list-item]
        assert reply.results[0][0][0] == "invalid_request_error"
        reply = await rpc.call(p.BatchPutStart(["ok-key", ""], [10, 10]))
        assert reply.results[0][0] is None and reply.results[1][0][0] == "invalid_request_error"
        await rpc.call(p.BatchPutRevoke(["ok-key"], [reply.results[0][1][0]]))
        # frames that are not store messages at all
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        garbage = [
            b"\xc1not msgpack",
            msgpack.packb(["store", 99, "put_start", {}]),
            msgpack.packb(["other", 1, "put_start", {}]),
            msgpack.packb(["store", 2, "no_such_tag", {}]),
            msgpack.packb(["store", 2, "put_start", {"key": "k", "size": 1, "bogus": 1}]),
            # nested parts are checked on decode
            msgpack.packb(["store", 2, "heartbeat", {"node_id": "n", "segments": "nope"}]),
            msgpack.packb(["store", 2, "heartbeat", {"node_id": "n", "segments": [["n0", "1"]]}]),
            msgpack.packb(
                ["store", 2, "batch_mount", {"node_id": "n", "segments": [["s", "r", 10, "h", 1]]}]
            ),
            msgpack.packb(["store", 2, "tasks_done", {"node_id": "n", "results": [[1, None]]}]),
        ]
        for i, frame in enumerate(garbage):
            await sock.send_multipart([i.to_bytes(8, "little"), frame])
            call_id, status, payload = await asyncio.wait_for(sock.recv_multipart(), 5)
            kind, message = msgpack.unpackb(payload)
            assert (status, kind) == (b"E", "invalid_request_error") and message
        sock.close(linger=0)
        assert (await rpc.call(p.Exists("keep"))).exists  # still serving
    finally:
        await rpc.close()
    assert master.get("/segments").json() == before
    assert master.get("/stats").json()["objects"] == 1 and await client.get("keep") == b"12345"


async def test_out_of_range_transfers_are_refused_and_change_nothing(store_cluster: Cluster) -> None:
    store_cluster.master()
    store_cluster.node("n0", size="1MiB")
    client = await store_cluster.client(transports=("tcp",))
    await client.put("k", b"\x01" * 1000)
    (replica,) = await client.replicas("k")
    engine = client.engine
    assert engine is not None
    src = client.register_buffer("oor", 8192)
    src.view_numpy()[:] = 0xEE
    size = 1 << 20
    results = await engine.transfer([
        TransferRequest(TransferOp.WRITE, "oor", 0, "n0", "dram", size - 100, 4096),  # runs past the end
        TransferRequest(TransferOp.WRITE, "oor", 0, "n0", "dram", size, 1),  # starts at the end
        TransferRequest(TransferOp.WRITE, "oor", 0, "n0", "no-such-region", 0, 16),
        TransferRequest(TransferOp.READ, "oor", 0, "n0", "dram", size + 4096, 16),
    ])  # fmt: skip
    assert [r.status for r in results] == [TransferStatus.FAILED] * 4
    assert all(r.error for r in results)
    assert "outside" in (results[0].error or "") and "no-such-region" in (results[2].error or "")
    assert await client.get("k") == b"\x01" * 1000  # nothing changed
    assert replica.offset == 0


async def test_clients_and_nodes_follow_a_master_that_moves(store_cluster: Cluster) -> None:
    first = store_cluster.master(port="0", node_ttl="6")  # any free port: found through the registry
    node = store_cluster.node("n0")
    client = await store_cluster.client(rpc_timeout_s=1.0)
    await client.put("moved", b"m" * 4096)
    assert client.master is not None
    old = client.master.endpoint
    store_cluster.wait_for(lambda: _in_redis(store_cluster, "moved"), 5, "the put written behind")
    first.kill()
    second = store_cluster.master(name="master2", port="0", node_ttl="6")
    new = "stream+" + await _rpc_endpoint(
        store_cluster, "rpc_stream"
    )  # the newest master, as clients name it
    assert new != old
    assert await client.get("moved") == b"m" * 4096  # first call times out; the registry names the new one
    assert client.master.endpoint == new
    store_cluster.wait_for(lambda: node.get("/segments").json()[0]["master"] == new, 8, "n0 to follow")
    assert await client.put("after-move", b"a" * 100) is True
    assert second.get("/stats").json()["objects"] == 2
