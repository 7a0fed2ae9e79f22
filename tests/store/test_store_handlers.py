"""The master's handlers over a real state, without processes: typed replies, the kept replica
descriptors against fresh ones, and the fast decode of batch gets against the plain one."""

from __future__ import annotations

import asyncio
import gc

import msgpack
import pytest
from yutu.errors import ErrorKind
from yutu.protocol import store as p
from yutu.protocol.codec import ProtocolError
from yutu.store.types import ReplicaState

from services.store_master.eager import run_eager
from services.store_master.handlers import Handlers
from services.store_master.replies import describe
from services.store_master.room import Room
from services.store_master.settle import EVENTS_BEHIND_S, Settler
from services.store_master.state import MasterState, StatePolicy
from services.store_master.tasks import TaskDispatcher


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[MasterState, Handlers]:
    state = MasterState(StatePolicy(lease_ttl_s=5.0), Clock())
    tasks = TaskDispatcher()
    settler = Settler(state, None, None, tasks)
    return state, Handlers(state, settler, Room(state, settler, tasks), tasks)


def call(handlers: Handlers, msg: object) -> object:
    """What the RPC server sends back, through the codec (these requests never wait)."""
    reply = run_eager(handlers.routes()[type(msg)](msg))  # type: ignore[arg-type]
    return p.CHANNEL.decode(p.CHANNEL.encode(reply))


async def test_put_then_get_sends_current_descriptors() -> None:
    state, handlers = make()
    mounted = call(handlers, p.BatchMountSegment("n0", [p.SegmentSpec("s0", "dram", 1 << 20, "h0", 1, 0)]))
    assert mounted == p.BatchReply([p.ok(1)])
    started = call(handlers, p.BatchPutStart(["a", "b", ""], [100, 200, 10], writer="w"))
    assert isinstance(started, p.BatchPutStartReply)
    slots = [p.unwrap(o) for o in started.results[:2]]
    assert [[(r.offset, r.length, r.state, r.host_id) for r in s.replicas] for s in slots] == [
        [(0, 100, ReplicaState.WRITING, "h0")],
        [(128, 200, ReplicaState.WRITING, "h0")],
    ]
    assert (
        started.results[2].error is not None
        and started.results[2].error.kind == ErrorKind.INVALID_REQUEST.value
    )
    ends = call(handlers, p.BatchPutEnd(["a", "b"], [s.put_id for s in slots if s.put_id is not None]))
    assert ends == p.BatchReply([p.ok(1), p.ok(1)])
    got = call(handlers, p.BatchGetReplicas(["a", "missing", "b"]))
    assert isinstance(got, p.BatchReplicasReply) and got.lease_ttl_s == 5.0
    fresh = [describe(state.segments, r) for key in ("a", "b") for r in state.objects[key].replicas]
    assert [r for o in (got.results[0], got.results[2]) for r in p.unwrap(o).replicas] == fresh
    assert all(r.state is ReplicaState.COMPLETE for r in fresh)  # not the WRITING ones kept at put_start
    assert got.results[1].error == p.Failure(
        ErrorKind.NOT_FOUND.value, "object 'missing' not found in the store"
    )
    single = call(handlers, p.GetReplicas("a"))
    assert single == p.ReplicasReply("a", 100, fresh[:1], 5.0)
    state.check()


async def test_stored_objects_leave_nothing_for_the_garbage_collector_to_walk() -> None:
    """A full collection walks every tracked object and stops the master meanwhile: a stored
    object's records, its replicas' tuple and the descriptors kept for readers are all untracked
    (services.store_master.objects), and a kept descriptor encodes as the NamedTuple would."""
    state, handlers = make()
    call(
        handlers,
        p.BatchMountSegment("n0", [p.SegmentSpec(f"s{i}", "dram", 1 << 20, "h0", 1, 0) for i in (0, 1)]),
    )
    started = call(handlers, p.BatchPutStart(["a", "b"], [100, 200], replicas=2, writer="w"))
    assert isinstance(started, p.BatchPutStartReply)
    slots = [p.unwrap(o) for o in started.results]
    call(handlers, p.BatchPutEnd(["a"], [slots[0].put_id]))  # "b" stays pending
    call(handlers, p.BatchGetReplicas(["a"]))
    reserved = call(handlers, p.BatchReserve([64], writer="w"))
    gc.collect()  # CPython untracks a tuple of untracked objects when a collection meets it
    a, b = state.objects["a"], state.objects["b"]
    assert b.pending is not None and len(a.replicas) == 2 and len(b.pending.replicas) == 2
    records: list[object] = [
        a,
        a.replicas,
        *a.replicas,
        b,
        b.pending,
        b.pending.replicas,
        *b.pending.replicas,
    ]
    records += [*state.reserved.values(), *(r for put in state.reserved.values() for r in put.replicas)]
    kept = [r.descriptor for r in a.replicas + b.pending.replicas]
    assert all(d is not None for d in kept) and isinstance(reserved, p.BatchReserveReply)
    assert len(state.reserved) == 1
    assert [o for o in records + kept if gc.is_tracked(o)] == []
    for replica in a.replicas:
        assert msgpack.packb(replica.descriptor) == msgpack.packb(describe(state.segments, replica))
    state.check()


FRAMES = [
    [[None, [100, [["s", "r", 0, 100, "complete", "h", "dram"]]]], [["not_found_error", "gone"], None]],
    [[None, [5, []]], [None, [7, [["s", "r", 64, 7, "complete", "", "dram"], ["t", "r", 0, 7, "complete", "", "dram"]]]]],
    [[None, ["5", []]]],
    [[None, [5, "nope"]]],
    [[None, [5, [["s", "r", -1, 7, "complete", "", "dram"]]]]],
    [[None, [5, [["s", "r", 0, 7, "complete", "", "dram"]]]], [["bogus_kind", "x"], None]],
    [[None]],
    "not a list",
]  # fmt: skip


@pytest.mark.parametrize("raw", FRAMES)
def test_the_fast_batch_get_decode_agrees_with_the_plain_one(raw: object) -> None:
    raw = msgpack.unpackb(msgpack.packb(raw))
    try:
        plain: object = p._outcomes(raw, p.ReplicaSet.from_wire)
    except ProtocolError as exc:
        with pytest.raises(ProtocolError) as fast:
            p.replica_set_outcomes(raw)
        assert type(fast.value) is type(exc)
        return
    assert p.replica_set_outcomes(raw) == plain


class Events:
    """Records every published batch (a KVEventPublisher's publish)."""

    def __init__(self) -> None:
        self.batches: list[list[object]] = []

    async def publish(self, events: list[object]) -> None:
        self.batches.append(list(events))


async def test_put_end_events_go_out_in_one_batch_per_window_and_before_any_later_event() -> None:
    """BEHIND put_ends hold their BlockStored for the write-behind window (one batch for all of
    them, the window's puts in one BlockStored); a later NOW operation publishes what is held
    first, so a key's BlockStored never follows its BlockRemoved; the window's timer then has
    nothing left to send."""
    state = MasterState(StatePolicy(lease_ttl_s=5.0), Clock())
    tasks = TaskDispatcher()
    events = Events()
    settler = Settler(state, None, events, tasks)  # type: ignore[arg-type]
    handlers = Handlers(state, settler, Room(state, settler, tasks), tasks)
    call(handlers, p.BatchMountSegment("n0", [p.SegmentSpec("s0", "dram", 1 << 20, "h0", 1, 0)]))
    for key in ("00aa", "00bb"):
        (slot,) = call(handlers, p.BatchPutStart([key], [100], writer="w")).results  # type: ignore[attr-defined]
        call(handlers, p.BatchPutEnd([key], [p.unwrap(slot).put_id]))
    assert events.batches == []  # held for the window
    call(handlers, p.Remove("00aa"))  # NOW: what is held goes out first, then its own
    names = [[(type(e).__name__, e.block_hashes) for e in batch] for batch in events.batches]  # type: ignore[attr-defined]
    assert names == [[
        ("BlockStored", [bytes.fromhex("00aa"), bytes.fromhex("00bb")]),
        ("BlockRemoved", [bytes.fromhex("00aa")]),
    ]]  # fmt: skip
    (slot,) = call(handlers, p.BatchPutStart(["00cc"], [100], writer="w")).results  # type: ignore[attr-defined]
    call(handlers, p.BatchPutEnd(["00cc"], [p.unwrap(slot).put_id]))
    await settler.close()  # at shutdown: published at once, not lost
    assert [type(e).__name__ for e in events.batches[-1]] == ["BlockStored"] and len(events.batches) == 2
    await asyncio.sleep(EVENTS_BEHIND_S * 2)  # the window's timer was cancelled: nothing more
    assert len(events.batches) == 2
    state.check()
