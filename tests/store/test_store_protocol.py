"""The store channel's typed parts: exact round trips, and malformed parts refused on decode."""

from __future__ import annotations

import msgpack
import pytest
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.protocol.codec import ProtocolError
from yutu.store.types import Medium, ReplicaDescriptor, ReplicaState

DRAM = ReplicaDescriptor("seg-a", "dram", 4096, 100, ReplicaState.COMPLETE, "host-1")
DISK = ReplicaDescriptor("seg-b", "dram", None, 100, ReplicaState.COMPLETE, "", Medium.DISK)


def frame(tag: str, fields: dict[str, object]) -> bytes:
    return msgpack.packb(["store", p.CHANNEL.version, tag, fields])


def roundtrip(msg: object) -> object:
    return p.CHANNEL.decode(p.CHANNEL.encode(msg))


def test_typed_parts_round_trip_exactly() -> None:
    messages = [
        p.BatchMountSegment("n0", [p.SegmentSpec("s0", "dram", 1 << 20, "h", 3, 0)]),
        p.Heartbeat("n0", [p.MountedSegment("s0", 3), p.MountedSegment("s1", 1)]),
        p.PutStartReply("k", "put-1", [DRAM]),
        p.PutStartReply("k", None, []),
        p.BatchPutStartReply([p.ok(p.PutSlot("put-2", [DRAM])), p.failed(ErrorKind.TOO_LARGE, "too big")]),
        p.ReplicasReply("k", 100, [DRAM, DISK], 5.0),
        p.BatchReplicasReply([p.ok(p.ReplicaSet(100, [DRAM])), p.failed(ErrorKind.NOT_FOUND, "gone")], 5.0),
        p.BatchReply([p.ok(1), p.ok(0), p.failed(ErrorKind.INVALID_REQUEST, "bad")]),
        p.TasksReply(
            [p.DiskTask("t1", "offload", "s0", "k", 0, 100), p.DiskTask("t2", "drop", "s0", "k", None, 1)]
        ),
        p.TasksDone("n0", [p.TaskResult("t1", None), p.TaskResult("t2", "disk full")]),
    ]
    for msg in messages:
        assert roundtrip(msg) == msg
    reply = roundtrip(messages[6])
    assert isinstance(reply, p.BatchReplicasReply)
    first = reply.results[0]
    assert type(first) is p.Outcome and type(first.value) is p.ReplicaSet
    assert (
        type(first.value.replicas[0]) is ReplicaDescriptor
        and first.value.replicas[0].state is ReplicaState.COMPLETE
    )
    assert p.unwrap(first) == p.ReplicaSet(100, [DRAM])
    with pytest.raises(YutuError) as err:
        p.unwrap(reply.results[1])
    assert err.value.kind is ErrorKind.NOT_FOUND and str(err.value) == "gone"


def test_the_wire_form_is_plain_arrays() -> None:
    raw = msgpack.unpackb(p.CHANNEL.encode(p.BatchReplicasReply([p.ok(p.ReplicaSet(100, [DRAM]))], 5.0)))
    assert raw == [
        "store", 2, "batch_replicas",
        {"results": [[None, [100, [["seg-a", "dram", 4096, 100, "complete", "host-1", "dram"]]]]], "lease_ttl_s": 5.0},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("tag", "fields", "names"),
    [
        ("heartbeat", {"node_id": "n", "segments": "nope"}, "list of MountedSegment"),
        ("heartbeat", {"node_id": "n", "segments": [["s0", "1"]]}, "heartbeat segment"),
        ("batch_mount", {"node_id": "n", "segments": [["s", "r", 10, "h", 1]]}, "segment spec"),
        ("batch_mount", {"node_id": "n", "segments": [["s", "r", "10", "h", 1, 0]]}, "segment spec"),
        ("tasks_done", {"node_id": "n", "results": [[1, None]]}, "task result"),
        ("tasks", {"tasks": [["t", "explode", "s", "k", 0, 1]]}, "disk task"),
        ("put_start_ok", {"key": "k", "put_id": "p", "replicas": [["s", "r", -1, 5, "complete", "", "dram"]]},
         "replica descriptor"),
        ("put_start_ok", {"key": "k", "put_id": "p", "replicas": [["s", "r", 0, 5, "done", "", "dram"]]},
         "replica descriptor"),
        ("batch_replicas", {"results": [[None, ["100", []]]], "lease_ttl_s": 1.0}, "replica set"),
        ("batch_replicas", {"results": [[["no_such_kind", "x"], None]], "lease_ttl_s": 1.0}, "failure"),
        ("batch_put_start_ok", {"results": [[None, [None]]]}, "put slot"),
        ("batch", {"results": [[None, "1"]]}, "count"),
        ("batch", {"results": [[None]]}, "outcome"),
    ],
)  # fmt: skip
def test_malformed_parts_fail_the_decode(tag: str, fields: dict[str, object], names: str) -> None:
    with pytest.raises(ProtocolError, match=names):
        p.CHANNEL.decode(frame(tag, fields))
