"""Reservations: puts into space reserved ahead (one transfer and one commit), against the classic
put_start / put_end protocol as the reference -- the master's state with a fake clock, then real
processes (a master restarted under a client that holds reservations, a reservation lost behind
the client's back, reservations given back on close)."""

from __future__ import annotations

import os
import time

import pytest
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.protocol.kv_events import BlockStored
from yutu.store.types import ReplicaState

from services.store_master.state import MasterState
from tests.store.conftest import Cluster
from tests.store.test_store_state import make

# -- the master's state ---------------------------------------------------------------------------


def test_a_committed_reservation_is_the_object_at_the_reserved_offset() -> None:
    st, _ = make()
    first = st.reserve(100, writer="w")
    second = st.reserve(300, writer="w")
    assert [(r.segment, r.offset, r.length, r.state) for r in first.replicas] == [
        ("seg0", 0, 100, ReplicaState.WRITING)
    ]
    assert [(r.segment, r.offset) for r in second.replicas] == [("seg1", 0)]  # placed as put_start places
    assert st.effects.dirty_objects == set() and not st.exists("k")  # no object, nothing to persist
    st.check()

    assert st.commit("k", first.put_id) is False  # stored, nothing released
    size, replicas = st.get_replicas("k")  # type: ignore[misc]
    assert (size, [(r.segment, r.offset, r.state) for r in replicas]) == (
        100, [("seg0", 0, ReplicaState.COMPLETE)],
    )  # fmt: skip
    effects = st.take_effects()
    assert effects.dirty_objects == {"k"}
    assert [type(e) for e in effects.events] == [BlockStored]
    assert list(st.reserved) == [second.put_id]
    st.check()


def test_a_stored_key_keeps_the_reservation_and_an_upsert_replaces_the_object() -> None:
    st, clock = make(segments=1)
    old = st.reserve(100)
    st.commit("k", old.put_id)
    r = st.reserve(100)
    assert st.commit("k", r.put_id) is None  # already stored: nothing changes
    assert r.put_id in st.reserved
    assert st.get_replicas("k")[1][0].offset == 0  # type: ignore[index]
    assert st.commit("k", r.put_id, upsert=True) is True  # released the old replica
    assert st.get_replicas("k")[1][0].offset == 128  # type: ignore[index]
    assert not st.reserved
    st.check()
    assert st.segments.used_bytes == 256  # the old replica is leased (the reads above): retired
    clock.now += 6.0
    st.sweep()
    assert st.segments.used_bytes == 128
    st.check()


def test_commit_refuses_unknown_reservations_and_bad_keys_and_keeps_the_reservation() -> None:
    st, _ = make()
    r = st.reserve(64)
    with pytest.raises(YutuError) as err:
        st.commit("k", "no-such-put")
    assert err.value.kind is ErrorKind.NOT_FOUND
    with pytest.raises(YutuError) as err:
        st.commit("", r.put_id)
    assert err.value.kind is ErrorKind.INVALID_REQUEST
    assert r.put_id in st.reserved
    st.put_start("busy", 64)  # a put of the key in progress
    assert st.commit("busy", r.put_id) is None
    with pytest.raises(YutuError) as err:
        st.commit("busy", r.put_id, upsert=True)
    assert err.value.kind is ErrorKind.OVERLOADED
    assert r.put_id in st.reserved
    st.check()


def test_reservations_are_freed_when_given_back_reclaimed_or_their_segment_is_lost() -> None:
    st, clock = make(segments=2)
    given = st.reserve(100)
    st.unreserve(given.put_id)
    with pytest.raises(YutuError) as err:
        st.unreserve(given.put_id)
    assert err.value.kind is ErrorKind.NOT_FOUND
    assert st.segments.used_bytes == 0

    late = st.reserve(100)  # seg0
    st.reserve(100)  # on seg1
    clock.now += 5.0
    young = st.reserve(100)  # seg0, made 5 s later
    clock.now += 5.5  # `late` and the one on seg1 are past the 10 s put timeout, `young` is not
    st.drop_segment("seg1")
    st.sweep()
    assert list(st.reserved) == [young.put_id]
    assert st.counters.reclaimed_puts == 1  # `late`; the one on seg1 went with its segment
    assert st.segments.used_bytes == 128
    with pytest.raises(YutuError) as err:
        st.commit("k", late.put_id)
    assert err.value.kind is ErrorKind.NOT_FOUND
    st.check()


def test_a_restored_master_knows_no_reservation() -> None:
    st, _ = make()
    st.reserve(100)
    fresh = MasterState(st.policy, st.clock)
    fresh.restore(list(st.segments.segments.values()), [])
    assert not fresh.reserved and fresh.segments.used_bytes == 0


# -- real processes ---------------------------------------------------------------------------------


def _ops(master: object, op: str) -> float:
    """The master's count of ``op`` calls answered ok (0 when it never saw one)."""
    line = f'yutu_store_ops_total{{op="{op}",outcome="ok"}} '
    for text in master.get("/metrics").text.splitlines():  # type: ignore[attr-defined]
        if text.startswith(line):
            return float(text[len(line) :])
    return 0.0


async def test_puts_through_reservations_answer_and_store_exactly_as_classic_puts(
    store_cluster: Cluster,
) -> None:
    master = store_cluster.master()
    store_cluster.node("n0")
    store_cluster.node("n1")
    reserved = await store_cluster.client(transports=("tcp",))
    classic = await store_cluster.client(transports=("tcp",), reserve_bytes=0)
    sizes = [1, 100, 4096, 65_536, 65_536, 300_001]
    for client, tag in ((reserved, "r"), (classic, "c")):
        blobs = {f"{tag}{i}": os.urandom(n) for i, n in enumerate(sizes)}
        singles = [await client.put(k, v) for k, v in list(blobs.items())[:3]]
        batch = await client.put_batch(list(blobs.items())[3:])
        again = await client.put_batch(list(blobs.items())[:4])  # already stored
        upserted = await client.put(f"{tag}0", b"new", upsert=True)
        pinned = await client.put(f"{tag}pin", b"p" * 999, soft_pin=True)
        assert (singles, batch, again, upserted, pinned) == ([True] * 3, [True] * 3, [False] * 4, True, True)
        assert await client.get_batch(list(blobs)) == [b"new", *list(blobs.values())[1:]]
        assert master.get(f"/objects/{tag}pin").json()["soft_pin"] is True
    # the classic client's 7 calls started a put (6 ended one: `again` found every key stored);
    # the reserving client never started one the classic way, and each of its 7 calls committed once
    assert (_ops(master, "BatchPutStart"), _ops(master, "BatchPutEnd")) == (7, 6)
    assert _ops(master, "BatchPutCommit") == 7
    assert 1 <= _ops(master, "BatchReserve") <= 6  # sizes not held yet
    assert master.post("/debug/check_integrity").json()["ok"] is True


async def test_a_restarted_master_never_gets_writes_into_reservations_it_forgot(
    store_cluster: Cluster,
) -> None:
    """The first-fit allocator of a restarted master hands the space of the client's old
    reservations to the next put: had the client written there, that object would be corrupt."""
    master = store_cluster.master()
    store_cluster.node("n0")
    writer = await store_cluster.client(transports=("tcp",))
    other = await store_cluster.client(transports=("tcp",), reserve_bytes=0)
    assert await writer.put_batch({f"w{i}": os.urandom(10_000) for i in range(4)}) == [True] * 4
    assert master.get("/stats").json()["reserved_puts"] == 4  # held for the next put of that size
    store_cluster.wait_for(
        lambda: master.get("/stats").json()["metadata_writes"] > 0, 5, "the puts persisted"
    )
    master.kill()
    master = store_cluster.restart(master)
    theirs = {f"o{i}": os.urandom(10_000) for i in range(4)}
    assert await other.put_batch(theirs) == [True] * 4  # into the space the old reservations held
    mine = {f"m{i}": os.urandom(10_000) for i in range(4)}
    assert await writer.put_batch(mine) == [True] * 4
    assert await other.get_batch(list(theirs)) == list(theirs.values())
    assert await writer.get_batch(list(mine)) == list(mine.values())
    assert master.post("/debug/check_integrity").json()["ok"] is True


async def test_a_reservation_lost_behind_the_clients_back_falls_back_to_a_classic_put(
    store_cluster: Cluster,
) -> None:
    master = store_cluster.master()
    store_cluster.node("n0")
    client = await store_cluster.client()
    assert await client.put("a", b"1" * 5000) is True
    pool = client._io.reservations
    assert pool is not None and pool.held_bytes == 5000
    held = pool.take(5000, client.master.session, time.monotonic())  # type: ignore[union-attr, arg-type]
    assert held is not None
    pool.add(held)  # the client keeps it: as if the master had reclaimed it meanwhile
    reply = await client.master.call(p.BatchUnreserve([held.put_id]))  # type: ignore[union-attr]
    assert [p.unwrap(o) for o in reply.results] == [1]
    assert await client.put("b", b"2" * 5000) is True  # commit: NOT_FOUND, then put_start / put_end
    assert await client.get("b") == b"2" * 5000
    assert _ops(master, "BatchPutStart") == 1
    assert master.post("/debug/check_integrity").json()["ok"] is True


async def test_closing_the_client_gives_its_reservations_back(store_cluster: Cluster) -> None:
    master = store_cluster.master()
    store_cluster.node("n0")
    client = await store_cluster.client()
    assert await client.put_batch({f"k{i}": b"x" * 1000 for i in range(8)}) == [True] * 8
    assert master.get("/stats").json()["reserved_puts"] == 8
    await client.close()
    stats = master.get("/stats").json()
    assert (stats["reserved_puts"], stats["used"]) == (0, 8 * 1024)


async def test_reservations_on_a_lost_node_fall_back_to_classic_puts_on_the_live_one(
    store_cluster: Cluster,
) -> None:
    # node TTL 1.5 s; reservations usable for half the put timeout: longer than n0 takes to drop
    master = store_cluster.master(put_timeout="30")
    n0 = store_cluster.node("n0", size="32MiB")  # the most free space: placement picks it
    store_cluster.node("n1")
    client = await store_cluster.client(transports=("tcp",))
    assert await client.put_batch({f"a{i}": os.urandom(10_000) for i in range(8)}) == [True] * 8
    pool = client._io.reservations
    assert pool is not None
    segments = set()
    for _ in range(8):  # the client's reservations for its next put
        r = pool.take(10_000, client.master.session, time.monotonic())  # type: ignore[union-attr, arg-type]
        assert r is not None
        segments.add(r.replica.segment)
        pool.add(r)
    assert segments == {"n0"}
    n0.kill()
    store_cluster.wait_for(lambda: master.get("/stats").json()["segments"] == 1, 10, "n0 dropped")
    fresh = {f"b{i}": os.urandom(10_000) for i in range(8)}
    assert await client.put_batch(fresh) == [True] * 8  # n0's reservations: write fails, put classic
    assert await client.get_batch(list(fresh)) == list(fresh.values())
    assert {r.segment for k in fresh for r in await client.replicas(k)} == {"n1"}
    assert _ops(master, "BatchPutStart") == 1
    assert master.post("/debug/check_integrity").json()["ok"] is True
