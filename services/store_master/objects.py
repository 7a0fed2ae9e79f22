"""The master's records of objects, their replicas and puts in progress (plain data, no logic
beyond what a record can say about itself).

An object is readable once it has at least one COMPLETE replica. A put in progress (``pending``)
holds WRITING replicas; for an upsert the old COMPLETE replicas stay readable until ``put_end``
swaps them. Records serialise to msgpack-native lists for Redis (``to_wire``).

The per-object records (:class:`ObjectEntry`, :class:`PendingPut`, :class:`Replica`) are msgspec
Structs that CPython's garbage collector does not track (``gc=False``), their replicas in tuples
(which CPython stops tracking once they hold only untracked objects), and a replica's kept
descriptor is a plain tuple of strings, ints and None (see services.store_master.replies). A full
collection walks every tracked object and stops the master meanwhile: as dataclasses in lists,
each stored object was four tracked objects and a full collection took ~110 ms at 100,000 objects
(``loadtests/bench_gc.py`` measures both shapes). An untracked object is never collected as part
of a cycle, so no record refers back to anything that refers to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from yutu.store.types import Medium, ReplicaDescriptor, ReplicaState


class Replica(msgspec.Struct, gc=False):
    segment: str
    offset: int | None  # DRAM: start of the allocation in the segment; DISK: None
    length: int
    state: ReplicaState
    medium: Medium = Medium.DRAM
    # what readers are sent, kept once built (see services.store_master.replies; not persisted)
    descriptor: ReplicaDescriptor | None = None

    def to_wire(self) -> list[Any]:
        return [self.segment, self.offset, self.length, self.state.value, self.medium.value]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> Replica:
        segment, offset, length, state, medium = raw
        return cls(segment, offset, length, ReplicaState(state), Medium(medium))


class PendingPut(msgspec.Struct, gc=False):
    put_id: str
    size: int
    replicas: tuple[Replica, ...]
    started_at: float  # wall clock; the put is reclaimed at started_at + put timeout
    writer: str

    def to_wire(self) -> list[Any]:
        return [self.put_id, self.size, [r.to_wire() for r in self.replicas], self.started_at, self.writer]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> PendingPut:
        put_id, size, replicas, started_at, writer = raw
        return cls(put_id, size, tuple(Replica.from_wire(r) for r in replicas), started_at, writer)


class ObjectEntry(msgspec.Struct, gc=False):
    key: str
    size: int  # bytes of the COMPLETE generation; 0 while only a first put is pending
    replicas: tuple[Replica, ...]  # COMPLETE replicas, DRAM and DISK
    created_at: float
    pending: PendingPut | None = None
    soft_pin: bool = False
    pin_until: float = 0.0  # wall clock; pinned while now < pin_until
    lease_until: float = 0.0  # wall clock; leased while now < lease_until (not persisted)
    busy: str | None = None  # "offloading" | "promoting" while a disk-tier task runs (not persisted)
    access_count: int = 0

    @property
    def readable(self) -> bool:
        return bool(self.replicas)

    def dram_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.medium is Medium.DRAM]

    def disk_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.medium is Medium.DISK]

    def protection(self, now: float) -> str | None:
        """Why eviction must skip this object now, or None if it may be evicted."""
        if now < self.lease_until:
            return "leased"
        if self.pending is not None:
            return "writing"
        if self.soft_pin and now < self.pin_until:
            return "pinned"
        if self.busy is not None:
            return self.busy
        return None

    def to_wire(self) -> list[Any]:
        return [
            self.size,
            [r.to_wire() for r in self.replicas],
            self.created_at,
            None if self.pending is None else self.pending.to_wire(),
            self.soft_pin,
            self.pin_until,
            self.access_count,
        ]

    @classmethod
    def from_wire(cls, key: str, raw: list[Any]) -> ObjectEntry:
        size, replicas, created_at, pending, soft_pin, pin_until, access_count = raw
        return cls(
            key=key,
            size=size,
            replicas=tuple(Replica.from_wire(r) for r in replicas),
            created_at=created_at,
            pending=None if pending is None else PendingPut.from_wire(pending),
            soft_pin=soft_pin,
            pin_until=pin_until,
            access_count=access_count,
        )


@dataclass(slots=True)
class Segment:
    """A mounted segment: a region of some node's registered memory, plus its disk tier."""

    name: str
    region: str
    size: int
    host_id: str
    node_id: str
    incarnation: int
    disk_capacity: int = 0
    disk_used: int = 0
    mounted_at: float = 0.0
    last_seen: float = 0.0  # wall clock of the last heartbeat (not persisted: reset on recovery)
    # objects with a DISK replica here, in the order they got it (a full disk drops the oldest first)
    disk_keys: dict[str, None] = field(default_factory=dict)

    def to_wire(self) -> list[Any]:
        return [
            self.region,
            self.size,
            self.host_id,
            self.node_id,
            self.incarnation,
            self.disk_capacity,
            self.mounted_at,
        ]

    @classmethod
    def from_wire(cls, name: str, raw: list[Any]) -> Segment:
        region, size, host_id, node_id, incarnation, disk_capacity, mounted_at = raw
        return cls(name, region, size, host_id, node_id, incarnation, disk_capacity, 0, mounted_at)


@dataclass(frozen=True, slots=True)
class NodeTask:
    """Disk-tier work for the node that owns ``segment``."""

    task_id: str
    node_id: str
    op: str  # "offload" | "promote" | "drop"
    segment: str
    key: str
    offset: int | None  # DRAM offset to read from (offload) or write to (promote)
    length: int

    def to_wire(self) -> list[Any]:
        return [self.task_id, self.op, self.segment, self.key, self.offset, self.length]
