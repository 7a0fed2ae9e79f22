"""The store channel: clients and store nodes talking to the store master (ZeroMQ RPC).

Calls (request -> reply), after Mooncake's master RPCs::

    MountSegment / BatchMountSegment        -> Ack / BatchReply       a node contributes memory
    UnmountSegment / BatchUnmountSegment    -> Ack / BatchReply       its replicas are dropped
    Heartbeat                               -> HeartbeatReply         liveness; lists segments to remount
    PutStart / BatchPutStart                -> PutStartReply / BatchReply   allocate: where to write
    PutEnd / BatchPutEnd                    -> Ack / BatchReply       bytes written: make readable
    PutRevoke / BatchPutRevoke              -> Ack / BatchReply       writer gave up: free the space
    GetReplicas / BatchGetReplicas          -> ReplicasReply / BatchReply   grants a read lease
    Exists / BatchExists                    -> ExistsReply / BatchExistsReply
    Remove / BatchRemove / RemoveAll        -> Ack / BatchReply / Ack
    FetchTasks (long poll) / TasksDone      -> TasksReply / Ack       disk-tier work for a node
    GetStats                                -> StatsReply

A single call that fails raises ``YutuError`` at the caller (see :mod:`yutu.rpc`). A batch call
never fails as a whole for one bad key: ``BatchReply.results`` holds one outcome per key, in order::

    [None, value]            success; value as in the single reply (see each message)
    [[kind, message], None]  failure of that key; kind is a yutu.errors.ErrorKind value

For Mooncake Store users: PutStart/PutEnd/PutRevoke, MountSegment/UnmountSegment and RemoveAll
keep their names; GetReplicas is GetReplicaList, Exists is ExistKey, Heartbeat is Ping;
``PutOptions(replicas, soft_pin)`` is ReplicateConfig(replica_num, with_soft_pin). Master flags:
``--lease-ttl`` (default_kv_lease_ttl), ``--soft-pin-ttl`` (default_kv_soft_pin_ttl),
``--eviction-high-watermark`` (eviction_high_watermark_ratio), ``--eviction-ratio``,
``--node-ttl`` (client_live_ttl_sec), ``--put-timeout`` (put_start_discard_timeout_sec).

Replicas travel as :meth:`yutu.store.types.ReplicaDescriptor.to_wire` lists. Fields are not trusted
by the decoder: the master validates every value and refuses bad ones with INVALID_REQUEST.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.codec import Channel

CHANNEL = Channel("store", version=1)

Outcome = list[Any]  # [None, value] | [[kind, message], None]


def ok(value: Any) -> Outcome:
    return [None, value]


def failed(kind: ErrorKind, message: str) -> Outcome:
    return [[kind.value, message], None]


def unwrap(outcome: Outcome) -> Any:
    """The value of a successful outcome; raises the ``YutuError`` of a failed one."""
    error, value = outcome
    if error is not None:
        kind, message = error
        raise YutuError(message, ErrorKind(kind))
    return value


# -- segments and liveness ---------------------------------------------------------------------


@CHANNEL.message("mount")
@dataclass
class MountSegment:
    """Contribute ``size`` bytes of region ``region`` of transfer segment ``segment``.

    Idempotent for the same ``incarnation``; a new incarnation (the node restarted) drops every
    replica the old one held. ``disk_capacity`` > 0 offers a disk tier for evicted objects.
    """

    node_id: str
    segment: str
    region: str
    size: int
    host_id: str
    incarnation: int
    disk_capacity: int = 0


@CHANNEL.message("batch_mount")
@dataclass
class BatchMountSegment:
    node_id: str
    # one [segment, region, size, host_id, incarnation, disk_capacity] per segment
    segments: list[list[Any]]


@CHANNEL.message("unmount")
@dataclass
class UnmountSegment:
    node_id: str
    segment: str


@CHANNEL.message("batch_unmount")
@dataclass
class BatchUnmountSegment:
    node_id: str
    segments: list[str]


@CHANNEL.message("heartbeat")
@dataclass
class Heartbeat:
    node_id: str
    segments: list[list[Any]]  # [segment, incarnation] for every segment the node believes mounted


@CHANNEL.message("heartbeat_ok")
@dataclass
class HeartbeatReply:
    remount: list[str]  # segments the master does not know (e.g. it lost them): mount them again


# -- objects -----------------------------------------------------------------------------------


@CHANNEL.message("put_start")
@dataclass
class PutStart:
    key: str
    size: int
    replicas: int = 1
    soft_pin: bool = False
    upsert: bool = False
    writer: str = ""  # who writes (client id), for admin pages and logs


@CHANNEL.message("put_start_ok")
@dataclass
class PutStartReply:
    """``put_id`` None: the key is already stored (or being stored) and nothing is to be written.

    Batch value: ``[put_id, replicas]``.
    """

    key: str
    put_id: str | None
    replicas: list[list[Any]] = field(default_factory=list)


@CHANNEL.message("batch_put_start")
@dataclass
class BatchPutStart:
    keys: list[str]
    sizes: list[int]
    replicas: int = 1
    soft_pin: bool = False
    upsert: bool = False
    writer: str = ""


@CHANNEL.message("put_end")
@dataclass
class PutEnd:
    key: str
    put_id: str


@CHANNEL.message("batch_put_end")
@dataclass
class BatchPutEnd:
    keys: list[str]
    put_ids: list[str]


@CHANNEL.message("put_revoke")
@dataclass
class PutRevoke:
    key: str
    put_id: str


@CHANNEL.message("batch_put_revoke")
@dataclass
class BatchPutRevoke:
    keys: list[str]
    put_ids: list[str]


@CHANNEL.message("get_replicas")
@dataclass
class GetReplicas:
    key: str


@CHANNEL.message("replicas")
@dataclass
class ReplicasReply:
    """Complete replicas of ``key``; they stay valid (not evicted, not freed) for ``lease_ttl_s``.

    Batch value: ``[size, replicas]``; the lease is ``BatchReply.lease_ttl_s``.
    """

    key: str
    size: int
    replicas: list[list[Any]]
    lease_ttl_s: float


@CHANNEL.message("batch_get_replicas")
@dataclass
class BatchGetReplicas:
    keys: list[str]


@CHANNEL.message("exists")
@dataclass
class Exists:
    key: str


@CHANNEL.message("exists_ok")
@dataclass
class ExistsReply:
    exists: bool


@CHANNEL.message("batch_exists")
@dataclass
class BatchExists:
    keys: list[str]


@CHANNEL.message("batch_exists_ok")
@dataclass
class BatchExistsReply:
    exists: list[bool]


@CHANNEL.message("remove")
@dataclass
class Remove:
    """Remove ``key``. Space that a lease holder may still read is freed when the lease ends."""

    key: str


@CHANNEL.message("batch_remove")
@dataclass
class BatchRemove:
    keys: list[str]


@CHANNEL.message("remove_all")
@dataclass
class RemoveAll:
    pass


# -- disk tier work for store nodes ------------------------------------------------------------


@CHANNEL.message("fetch_tasks")
@dataclass
class FetchTasks:
    """Long poll: answered as soon as the master has work for ``node_id``, or after ``wait_s``."""

    node_id: str
    wait_s: float


@CHANNEL.message("tasks")
@dataclass
class TasksReply:
    # [task_id, op, segment, key, offset, length]; op "offload": copy region bytes to the disk
    # tier; "promote": copy the file into the region at offset; "drop": delete the file
    tasks: list[list[Any]]


@CHANNEL.message("tasks_done")
@dataclass
class TasksDone:
    node_id: str
    results: list[list[Any]]  # [task_id, error message or None]


# -- generic replies ---------------------------------------------------------------------------


@CHANNEL.message("ack")
@dataclass
class Ack:
    count: int = 0  # how many things the call changed (e.g. objects removed)


@CHANNEL.message("batch")
@dataclass
class BatchReply:
    results: list[Outcome]
    lease_ttl_s: float = 0.0


@CHANNEL.message("get_stats")
@dataclass
class GetStats:
    pass


@CHANNEL.message("stats")
@dataclass
class StatsReply:
    stats: dict[str, Any]
