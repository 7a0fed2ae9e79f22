"""The store channel: clients and store nodes talking to the store master (ZeroMQ RPC).

Calls (request -> reply), after Mooncake's master RPCs::

    MountSegment / BatchMountSegment        -> Ack / BatchReply       a node contributes memory
    UnmountSegment / BatchUnmountSegment    -> Ack / BatchReply       its replicas are dropped
    Heartbeat                               -> HeartbeatReply         liveness; lists segments to remount
    PutStart / BatchPutStart                -> PutStartReply / BatchPutStartReply   allocate: where to write
    PutEnd / BatchPutEnd                    -> Ack / BatchReply       bytes written: make readable
    PutRevoke / BatchPutRevoke              -> Ack / BatchReply       writer gave up: free the space
    BatchReserve                            -> BatchReserveReply      allocate for puts keyed later
    BatchPutCommit                          -> BatchPutCommitReply    reserved space written: key it,
                                                                      make it readable, reserve again
    BatchUnreserve                          -> BatchReply             reservations given back
    GetReplicas / BatchGetReplicas          -> ReplicasReply / BatchReplicasReply   grants a read lease
    Exists / BatchExists                    -> ExistsReply / BatchExistsReply
    Remove / BatchRemove / RemoveAll        -> Ack / BatchReply / Ack
    FetchTasks (long poll) / TasksDone      -> TasksReply / Ack       disk-tier work for a node
    GetStats                                -> StatsReply

A single call that fails raises ``YutuError`` at the caller (see :mod:`yutu.rpc`). A batch call
never fails as a whole for one bad key: its reply's ``results`` hold one :class:`Outcome` per key,
in order::

    Outcome(None, value)                     success; value as in the single reply (see each message)
    Outcome(Failure(kind, message), None)    failure of that key; kind is a yutu.errors.ErrorKind value

For Mooncake Store users: PutStart/PutEnd/PutRevoke, MountSegment/UnmountSegment and RemoveAll
keep their names; GetReplicas is GetReplicaList, Exists is ExistKey, Heartbeat is Ping;
``PutOptions(replicas, soft_pin)`` is ReplicateConfig(replica_num, with_soft_pin). Master flags:
``--lease-ttl`` (default_kv_lease_ttl), ``--soft-pin-ttl`` (default_kv_soft_pin_ttl),
``--eviction-high-watermark`` (eviction_high_watermark_ratio), ``--eviction-ratio``,
``--node-ttl`` (client_live_ttl_sec), ``--put-timeout`` (put_start_discard_timeout_sec).

Nested parts are typed: :class:`~yutu.store.types.ReplicaDescriptor`, :class:`SegmentSpec`,
:class:`MountedSegment`, :class:`PutSlot`, :class:`ReplicaSet`, :class:`Outcome` /
:class:`Failure`, :class:`DiskTask`, :class:`TaskResult` -- NamedTuples, so they go on the wire as
msgpack arrays. Decoding checks them: a message whose parts are lists (as msgpack decodes them) has
each part checked and converted by ``__post_init__``, and a malformed part fails the decode with
:class:`~yutu.protocol.codec.ProtocolError` (the RPC server answers INVALID_REQUEST). A message
built from typed parts is taken as it is (only its first part's type is looked at). Values inside
the parts (key rules, sizes, known segments) are the master's to check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.codec import Channel, ProtocolError
from yutu.store.types import ReplicaDescriptor

CHANNEL = Channel("store", version=2)

T = TypeVar("T")
P = TypeVar("P")

_KINDS = frozenset(k.value for k in ErrorKind)


def _bad(part: str, raw: Any, want: str) -> ProtocolError:
    return ProtocolError(f"malformed {part} {raw!r} on channel store: want {want}")


def _is_str(value: Any) -> bool:
    return type(value) is str


def _is_int(value: Any) -> bool:
    return type(value) is int


def _parts(raw: Any, typed: type[P], decode: Callable[[Any], P]) -> list[P]:
    """``raw`` as a list of ``typed``: as it is when built from typed parts, else each decoded."""
    if type(raw) is not list:
        raise ProtocolError(f"a list of {typed.__name__} was expected on channel store, got {raw!r}")
    if not raw or type(raw[0]) is typed:
        return raw
    return [decode(item) for item in raw]


def replicas_from_wire(raw: Any) -> list[ReplicaDescriptor]:
    if type(raw) is not list:
        raise _bad("replica list", raw, "a list of replica descriptors")
    try:
        return [r if type(r) is ReplicaDescriptor else ReplicaDescriptor.from_wire(r) for r in raw]
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None


class SegmentSpec(NamedTuple):
    """One segment of a ``BatchMountSegment`` (the fields of :class:`MountSegment`)."""

    segment: str
    region: str
    size: int
    host_id: str
    incarnation: int
    disk_capacity: int = 0

    @classmethod
    def from_wire(cls, raw: Any) -> SegmentSpec:
        want = "[segment, region, size, host_id, incarnation, disk_capacity]"
        if type(raw) is not list or len(raw) != 6:
            raise _bad("segment spec", raw, want)
        segment, region, size, host_id, incarnation, disk = raw
        if not (_is_str(segment) and _is_str(region) and _is_str(host_id)) or not (
            _is_int(size) and _is_int(incarnation) and _is_int(disk)
        ):
            raise _bad("segment spec", raw, want + " (str, str, int, str, int, int)")
        return cls(segment, region, size, host_id, incarnation, disk)


class MountedSegment(NamedTuple):
    """A segment a node believes mounted, in its ``Heartbeat``."""

    segment: str
    incarnation: int

    @classmethod
    def from_wire(cls, raw: Any) -> MountedSegment:
        if type(raw) is not list or len(raw) != 2 or not _is_str(raw[0]) or not _is_int(raw[1]):
            raise _bad("heartbeat segment", raw, "[segment str, incarnation int]")
        return cls(raw[0], raw[1])


class Failure(NamedTuple):
    """Why one item of a batch failed: an :class:`~yutu.errors.ErrorKind` value and a message."""

    kind: str
    message: str

    @classmethod
    def from_wire(cls, raw: Any) -> Failure:
        if type(raw) is not list or len(raw) != 2 or raw[0] not in _KINDS or not _is_str(raw[1]):
            raise _bad("failure", raw, "[ErrorKind value, message str]")
        return cls(raw[0], raw[1])

    def error(self) -> YutuError:
        return YutuError(self.message, ErrorKind(self.kind))


class Outcome(NamedTuple, Generic[T]):
    """One item of a batch reply: ``Outcome(None, value)`` or ``Outcome(Failure(...), None)``."""

    error: Failure | None
    value: T | None

    @classmethod
    def from_wire(cls, raw: Any, value: Callable[[Any], T]) -> Outcome[T]:
        if type(raw) is not list or len(raw) != 2:
            raise _bad("outcome", raw, "[None, value] or [[kind, message], None]")
        if raw[0] is None:
            return cls(None, value(raw[1]))
        return cls(Failure.from_wire(raw[0]), None)


def ok(value: T) -> Outcome[T]:
    """``Outcome(None, value)``, without the NamedTuple's generated __new__ (once per batch item)."""
    return tuple.__new__(Outcome, (None, value))  # type: ignore[no-any-return]


def failed(kind: ErrorKind, message: str) -> Outcome[Any]:
    return Outcome(Failure(kind.value, message), None)


def unwrap(outcome: Outcome[T]) -> T:
    """The value of a successful outcome; raises the ``YutuError`` of a failed one."""
    error, value = outcome
    if error is not None:
        raise Failure(*error).error()
    return value  # type: ignore[return-value]  # None only with an error


def _outcomes(raw: Any, value: Callable[[Any], T]) -> list[Outcome[T]]:
    return _parts(raw, Outcome, lambda item: Outcome.from_wire(item, value))


class PutSlot(NamedTuple):
    """Where to write one key: ``put_id`` None means already stored, nothing to write."""

    put_id: str | None
    replicas: list[ReplicaDescriptor]

    @classmethod
    def from_wire(cls, raw: Any) -> PutSlot:
        if type(raw) is not list or len(raw) != 2 or not (raw[0] is None or _is_str(raw[0])):
            raise _bad("put slot", raw, "[put_id str or None, replicas]")
        return cls(raw[0], replicas_from_wire(raw[1]))


class ReplicaSet(NamedTuple):
    """A key's size and its COMPLETE DRAM replicas, under the reply's read lease."""

    size: int
    replicas: list[ReplicaDescriptor]

    @classmethod
    def from_wire(cls, raw: Any) -> ReplicaSet:
        if type(raw) is not list or len(raw) != 2 or not _is_int(raw[0]):
            raise _bad("replica set", raw, "[size int, replicas]")
        return cls(raw[0], replicas_from_wire(raw[1]))


_new = tuple.__new__  # a NamedTuple built from a tuple in C, without its generated __new__


def replica_set_outcomes(raw: Any) -> list[Outcome[ReplicaSet]]:
    """``_outcomes(raw, ReplicaSet.from_wire)`` with the common item -- a success with a size and
    a list of replicas -- decoded inline (the hot path of every get); anything else, failures and
    malformed items included, goes the plain way. Tests check that the two agree."""
    if type(raw) is not list or not raw or type(raw[0]) is Outcome:
        return _outcomes(raw, ReplicaSet.from_wire)
    out: list[Outcome[ReplicaSet]] = []
    replica = ReplicaDescriptor.from_wire
    try:
        for item in raw:
            if type(item) is list and len(item) == 2 and item[0] is None:
                value = item[1]
                if (
                    type(value) is list
                    and len(value) == 2
                    and type(value[0]) is int
                    and type(value[1]) is list
                ):
                    replicas = [replica(r) for r in value[1]]
                    out.append(_new(Outcome, (None, _new(ReplicaSet, (value[0], replicas)))))
                    continue
            out.append(Outcome.from_wire(item, ReplicaSet.from_wire))
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    return out


def _count(raw: Any) -> int:
    if not _is_int(raw):
        raise _bad("count", raw, "an int")
    return int(raw)


class DiskTask(NamedTuple):
    """Disk-tier work for a node: ``op`` "offload" copies region bytes at ``offset`` to the disk
    tier; "promote" copies the file into the region at ``offset``; "drop" deletes the file."""

    task_id: str
    op: str
    segment: str
    key: str
    offset: int | None
    length: int

    @classmethod
    def from_wire(cls, raw: Any) -> DiskTask:
        want = "[task_id, op, segment, key, offset int or None, length int]"
        if type(raw) is not list or len(raw) != 6:
            raise _bad("disk task", raw, want)
        task_id, op, segment, key, offset, length = raw
        if not (_is_str(task_id) and op in ("offload", "promote", "drop") and _is_str(segment)):
            raise _bad("disk task", raw, want)
        if not (_is_str(key) and (offset is None or _is_int(offset)) and _is_int(length)):
            raise _bad("disk task", raw, want)
        return cls(task_id, op, segment, key, offset, length)


class TaskResult(NamedTuple):
    """A node's result of one disk task: ``error`` None when it succeeded."""

    task_id: str
    error: str | None

    @classmethod
    def from_wire(cls, raw: Any) -> TaskResult:
        if type(raw) is not list or len(raw) != 2 or not _is_str(raw[0]):
            raise _bad("task result", raw, "[task_id str, error str or None]")
        if not (raw[1] is None or _is_str(raw[1])):
            raise _bad("task result", raw, "[task_id str, error str or None]")
        return cls(raw[0], raw[1])


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
    segments: list[SegmentSpec]

    def __post_init__(self) -> None:
        self.segments = _parts(self.segments, SegmentSpec, SegmentSpec.from_wire)


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
    segments: list[MountedSegment]  # every segment the node believes mounted

    def __post_init__(self) -> None:
        self.segments = _parts(self.segments, MountedSegment, MountedSegment.from_wire)


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
    """``put_id`` None: the key is already stored (or being stored) and nothing is to be written."""

    key: str
    put_id: str | None
    replicas: list[ReplicaDescriptor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.replicas = replicas_from_wire(self.replicas)


@CHANNEL.message("batch_put_start")
@dataclass
class BatchPutStart:
    keys: list[str]
    sizes: list[int]
    replicas: int = 1
    soft_pin: bool = False
    upsert: bool = False
    writer: str = ""


@CHANNEL.message("batch_put_start_ok")
@dataclass
class BatchPutStartReply:
    results: list[Outcome[PutSlot]]

    def __post_init__(self) -> None:
        self.results = _outcomes(self.results, PutSlot.from_wire)


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


@CHANNEL.message("batch_reserve")
@dataclass
class BatchReserve:
    """Allocate one replica of each size for puts whose keys the writer names when it commits
    them (:class:`BatchPutCommit`): a writer that holds reservations puts with one transfer and
    one RPC. Unused reservations are reclaimed ``ttl_s`` after they were made (the put timeout)."""

    sizes: list[int]
    writer: str = ""


@CHANNEL.message("batch_reserve_ok")
@dataclass
class BatchReserveReply:
    results: list[Outcome[PutSlot]]  # a reservation per size (its put_id and the one replica to write)
    ttl_s: float  # the master reclaims a reservation not committed this long after it was made

    def __post_init__(self) -> None:
        self.results = _outcomes(self.results, PutSlot.from_wire)


@CHANNEL.message("batch_put_commit")
@dataclass
class BatchPutCommit:
    """``keys[i]`` is written in reservation ``put_ids[i]``: make it readable (as put_end). Then
    free the reservations in ``release`` and make new ones of the sizes in ``refill``."""

    keys: list[str]
    put_ids: list[str]
    soft_pin: bool = False
    upsert: bool = False
    writer: str = ""
    refill: list[int] = field(default_factory=list)
    release: list[str] = field(default_factory=list)


@CHANNEL.message("batch_put_commit_ok")
@dataclass
class BatchPutCommitReply:
    """Per key 1 (stored) or 0 (already stored, not upserted: the reservation is still the
    writer's); NOT_FOUND when the reservation is gone (reclaimed, or its node was lost)."""

    results: list[Outcome[int]]
    refills: list[Outcome[PutSlot]]
    ttl_s: float

    def __post_init__(self) -> None:
        self.results = _outcomes(self.results, _count)
        self.refills = _outcomes(self.refills, PutSlot.from_wire)


@CHANNEL.message("batch_unreserve")
@dataclass
class BatchUnreserve:
    put_ids: list[str]


@CHANNEL.message("get_replicas")
@dataclass
class GetReplicas:
    key: str


@CHANNEL.message("replicas")
@dataclass
class ReplicasReply:
    """Complete replicas of ``key``; they stay valid (not evicted, not freed) for ``lease_ttl_s``."""

    key: str
    size: int
    replicas: list[ReplicaDescriptor]
    lease_ttl_s: float

    def __post_init__(self) -> None:
        self.replicas = replicas_from_wire(self.replicas)


@CHANNEL.message("batch_get_replicas")
@dataclass
class BatchGetReplicas:
    keys: list[str]


@CHANNEL.message("batch_replicas")
@dataclass
class BatchReplicasReply:
    """One :class:`ReplicaSet` per key, all under one read lease of ``lease_ttl_s``."""

    results: list[Outcome[ReplicaSet]]
    lease_ttl_s: float

    def __post_init__(self) -> None:
        self.results = replica_set_outcomes(self.results)


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
    tasks: list[DiskTask]

    def __post_init__(self) -> None:
        self.tasks = _parts(self.tasks, DiskTask, DiskTask.from_wire)


@CHANNEL.message("tasks_done")
@dataclass
class TasksDone:
    node_id: str
    results: list[TaskResult]

    def __post_init__(self) -> None:
        self.results = _parts(self.results, TaskResult, TaskResult.from_wire)


# -- generic replies ---------------------------------------------------------------------------


@CHANNEL.message("ack")
@dataclass
class Ack:
    count: int = 0  # how many things the call changed (e.g. objects removed)


@CHANNEL.message("batch")
@dataclass
class BatchReply:
    """The reply of the batch calls whose value per key is a count: mount and unmount (1 if it
    changed something), put_end and put_revoke (1), remove (1 if the key was there)."""

    results: list[Outcome[int]]

    def __post_init__(self) -> None:
        self.results = _outcomes(self.results, _count)


@CHANNEL.message("get_stats")
@dataclass
class GetStats:
    pass


@CHANNEL.message("stats")
@dataclass
class StatsReply:
    stats: dict[str, Any]
