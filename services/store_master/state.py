"""The store master's metadata: segments, objects, replicas, puts, leases, pins and eviction.

Every operation is synchronous and runs on the event loop, so each one is atomic with respect to
the others; nothing here does I/O. What an operation means for the outside world is collected in
``effects`` (objects and segments to persist, KV events to publish, disk-tier tasks to hand to
nodes) and taken by the service after each call with :meth:`MasterState.take_effects`.

Time is wall-clock seconds from the injected ``clock`` (tests pass a fake one). Space that a reader
may still be copying (leased replicas) or a writer may still be filling (a removed put) is not
freed at once but *retired* until the lease or the put deadline has passed.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.kv_events import BlockHash, BlockRemoved, BlockStored, KVEvent, key_to_hash
from yutu.store.allocator import align_up
from yutu.store.types import Medium, ReplicaState, validate_key

from services.store_master.disk_tier import DiskTier
from services.store_master.eviction import choose_victims
from services.store_master.objects import NodeTask, ObjectEntry, PendingPut, Replica, Segment
from services.store_master.segments import SegmentTable


class NoSpaceError(YutuError):
    """No segment can hold the object right now; the caller may evict and retry."""

    kind = ErrorKind.OVERLOADED


@dataclass(frozen=True)
class StatePolicy:
    lease_ttl_s: float = 5.0  # a read lease keeps replicas from eviction and freeing this long
    soft_pin_ttl_s: float = 1800.0  # a soft-pinned object is not evicted for this long after a put/read
    put_timeout_s: float = 30.0  # a put not ended by then is reclaimed (its writer is presumed gone)
    node_ttl_s: float = 10.0  # a segment whose node is silent this long is dropped
    high_watermark: float = 0.90  # evict when used / capacity passes this
    eviction_ratio: float = 0.05  # evict about this fraction of the capacity per round
    alignment: int = 64  # allocation granularity inside segments
    block_size: int = 16  # tokens per block, published in BlockStored events

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "soft_pin_ttl_s", "put_timeout_s", "node_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"high watermark must be in (0, 1], got {self.high_watermark}")
        if not 0.0 < self.eviction_ratio <= 1.0:
            raise ValueError(f"eviction ratio must be in (0, 1], got {self.eviction_ratio}")


@dataclass
class Effects:
    dirty_objects: set[str] = field(default_factory=set)
    dirty_segments: set[str] = field(default_factory=set)
    events: list[KVEvent] = field(default_factory=list)
    tasks: list[NodeTask] = field(default_factory=list)
    failed_tasks: list[str] = field(default_factory=list)  # task ids that can no longer finish

    def __bool__(self) -> bool:
        return bool(
            self.dirty_objects or self.dirty_segments or self.events or self.tasks or self.failed_tasks
        )


@dataclass
class Counters:
    evicted_objects: int = 0
    evicted_bytes: int = 0
    eviction_rounds: int = 0
    reclaimed_puts: int = 0
    lost_objects: int = 0  # removed because every replica's node died
    offloaded_objects: int = 0
    promoted_objects: int = 0


def _bad(message: str) -> YutuError:
    return YutuError(message, ErrorKind.INVALID_REQUEST)


def check_int(name: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _bad(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class MasterState:
    def __init__(self, policy: StatePolicy, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self.clock = clock
        self.segments = SegmentTable(policy.alignment)
        self.objects: dict[str, ObjectEntry] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # readable keys, least recently used first
        self.retired: list[tuple[float, str, int]] = []  # (free at, segment, offset)
        self.disk = DiskTier(self)
        self.counters = Counters()
        self.effects = Effects()
        # put ids: a random prefix per master process and a serial, unique across restarts and
        # cheaper than drawing 8 random bytes per put
        self._put_prefix = secrets.token_hex(4) + "-"
        self._put_serial = itertools.count(1)

    def take_effects(self) -> Effects:
        effects, self.effects = self.effects, Effects()
        return effects

    # -- segments --------------------------------------------------------------------------------

    def mount(
        self,
        node_id: str,
        name: str,
        region: str,
        size: int,
        host_id: str,
        incarnation: int,
        disk_capacity: int = 0,
    ) -> bool:
        """Mount a segment; True if new. The same incarnation again is a no-op (idempotent)."""
        for label, value in (
            ("node_id", node_id),
            ("segment", name),
            ("region", region),
            ("host_id", host_id),
        ):
            if not isinstance(value, str) or (label != "host_id" and not value):
                raise _bad(f"{label} must be a non-empty str, got {value!r}")
        check_int("size", size, 1)
        check_int("incarnation", incarnation)
        check_int("disk_capacity", disk_capacity)
        now = self.clock()
        existing = self.segments.get(name)
        if existing is not None:
            if existing.incarnation == incarnation and existing.size == size and existing.region == region:
                existing.last_seen = now
                existing.node_id = node_id
                return False
            self.drop_segment(name)  # the node restarted: what the old incarnation held is gone
        segment = Segment(name, region, size, host_id, node_id, incarnation, disk_capacity, 0, now, now)
        self.segments.add(segment)
        self.effects.dirty_segments.add(name)
        return True

    def unmount(self, node_id: str, name: str) -> int:
        """Unmount a segment of ``node_id``; returns how many replicas were dropped with it."""
        if not isinstance(name, str):
            raise _bad(f"segment must be a str, got {name!r}")
        segment = self.segments.get(name)
        if segment is None:
            return 0
        if segment.node_id != node_id:
            raise _bad(f"segment {name!r} is mounted by {segment.node_id!r}, not {node_id!r}")
        return self.drop_segment(name)

    def heartbeat(self, node_id: str, segments: list[tuple[str, int]]) -> list[str]:
        """Refresh liveness; returns the listed segments the master does not know (to remount)."""
        now = self.clock()
        remount: list[str] = []
        for name, incarnation in segments:
            segment = self.segments.get(name)
            if segment is None or segment.incarnation != incarnation:
                remount.append(name)
            else:
                segment.last_seen = now
        return remount

    def drop_segment(self, name: str) -> int:
        """Forget a segment and every replica on it; objects left without replicas are removed."""
        dropped = 0
        for key in [k for k, e in self.objects.items() if self._touches(e, name)]:
            entry = self.objects[key]
            before = len(entry.replicas)
            entry.replicas = [r for r in entry.replicas if r.segment != name]
            dropped += before - len(entry.replicas)
            if entry.pending is not None:
                kept = [r for r in entry.pending.replicas if r.segment != name]
                dropped += len(entry.pending.replicas) - len(kept)
                entry.pending.replicas = kept
                if not kept:
                    entry.pending = None  # its writer's put_end will be told the put is gone
            if not entry.replicas:
                self.lru.pop(key, None)
                if before:
                    self.counters.lost_objects += 1
                    self.effects.events.append(BlockRemoved([key_to_hash(key)]))
                if entry.pending is None:
                    del self.objects[key]
            self.effects.dirty_objects.add(key)
        self.retired = [r for r in self.retired if r[1] != name]
        self.disk.segment_dropped(name)
        self.segments.remove(name)
        self.effects.dirty_segments.add(name)
        return dropped

    @staticmethod
    def _touches(entry: ObjectEntry, segment: str) -> bool:
        if any(r.segment == segment for r in entry.replicas):
            return True
        return entry.pending is not None and any(r.segment == segment for r in entry.pending.replicas)

    # -- puts ------------------------------------------------------------------------------------

    def put_start(
        self,
        key: str,
        size: int,
        replicas: int = 1,
        soft_pin: bool = False,
        upsert: bool = False,
        writer: str = "",
    ) -> tuple[str | None, list[Replica]]:
        """Allocate replicas for ``key``: ``(put_id, replicas)`` to write, then ``put_end``.

        ``(None, [])`` when the key is already stored or being stored and ``upsert`` is false.
        Raises :class:`NoSpaceError` when no segment has room (the caller evicts and retries).
        """
        try:
            validate_key(key)
        except ValueError as exc:
            raise _bad(str(exc)) from None
        check_int("size", size, 1)
        check_int("replicas", replicas, 1)
        entry = self.objects.get(key)
        if entry is not None:
            if entry.pending is not None:
                if not upsert:
                    return None, []
                raise YutuError(
                    f"key {key!r} is being written by {entry.pending.writer or 'another writer'}; retry the upsert "
                    "after that put ends",
                    ErrorKind.OVERLOADED,
                )
            if entry.readable and not upsert:
                return None, []
        if size > self.segments.largest_segment:
            if not len(self.segments):
                raise YutuError("no store segment is mounted: start a store node", ErrorKind.UNAVAILABLE)
            raise YutuError(
                f"object of {size} bytes is larger than the largest segment ({self.segments.largest_segment} "
                "bytes): split it or mount bigger segments",
                ErrorKind.TOO_LARGE,
            )
        placed = self.segments.place(size, replicas)
        if not placed:
            raise NoSpaceError(f"no segment has {size} free bytes for {key!r}: evict or add capacity")
        now = self.clock()
        put_id = f"{self._put_prefix}{next(self._put_serial):x}"
        pending = PendingPut(
            put_id,
            size,
            [Replica(name, offset, size, ReplicaState.WRITING) for name, offset in placed],
            now,
            writer if isinstance(writer, str) else "",
        )
        if entry is None:
            entry = ObjectEntry(key, 0, [], now)
            self.objects[key] = entry
        entry.pending = pending
        entry.soft_pin = bool(soft_pin) or (upsert and entry.soft_pin)
        self.effects.dirty_objects.add(key)
        return put_id, pending.replicas

    def put_end(self, key: str, put_id: str) -> None:
        """Make the pending put readable; replaced replicas (upsert) are released."""
        entry, pending = self._pending(key, put_id)
        now = self.clock()
        was_readable = entry.readable
        if entry.busy is not None:  # an upsert overtook a disk-tier move: that move no longer applies
            self.disk.forget(entry)
            entry.busy = None
        for replica in entry.replicas:
            self._release(entry, replica)
        for replica in pending.replicas:
            replica.state = ReplicaState.COMPLETE
        entry.replicas = pending.replicas
        entry.size = pending.size
        entry.pending = None
        if entry.soft_pin:
            entry.pin_until = now + self.policy.soft_pin_ttl_s
        self.lru[key] = None
        self.lru.move_to_end(key)
        self.effects.dirty_objects.add(key)
        if not was_readable:
            self.effects.events.append(BlockStored([key_to_hash(key)], block_size=self.policy.block_size))

    def put_revoke(self, key: str, put_id: str) -> None:
        """Abandon a pending put; its space is freed at once (the writer says it stopped)."""
        entry, pending = self._pending(key, put_id)
        for replica in pending.replicas:
            assert replica.offset is not None
            self.segments.free(replica.segment, replica.offset)
        entry.pending = None
        if not entry.readable:
            del self.objects[key]
        self.effects.dirty_objects.add(key)

    def _pending(self, key: str, put_id: str) -> tuple[ObjectEntry, PendingPut]:
        entry = self.objects.get(key) if isinstance(key, str) else None
        if entry is None or entry.pending is None or entry.pending.put_id != put_id:
            raise YutuError(
                f"no put {put_id!r} is in progress for {key!r} (revoked, timed out, removed or its node was "
                "lost): put the object again",
                ErrorKind.NOT_FOUND,
            )
        return entry, entry.pending

    # -- reads -----------------------------------------------------------------------------------

    def get_replicas(self, key: str, now: float | None = None) -> tuple[int, list[Replica]] | None:
        """``(size, DRAM replicas)`` under a fresh lease; None if only a disk copy exists (promote it).

        Raises NOT_FOUND when the key has no complete replica. ``now``: the clock, read once by a
        caller leasing many keys (default: read here).
        """
        entry = self.objects.get(key) if isinstance(key, str) else None
        if entry is None or not entry.replicas:
            raise YutuError(f"object {key!r} not found in the store", ErrorKind.NOT_FOUND)
        dram = entry.dram_replicas()
        if not dram:
            return None
        if now is None:
            now = self.clock()
        entry.lease_until = max(entry.lease_until, now + self.policy.lease_ttl_s)
        if entry.soft_pin:
            entry.pin_until = now + self.policy.soft_pin_ttl_s
        entry.access_count += 1
        self.lru.move_to_end(key)
        return entry.size, dram

    def exists(self, key: str) -> bool:
        entry = self.objects.get(key) if isinstance(key, str) else None
        return entry is not None and entry.readable

    # -- removal ---------------------------------------------------------------------------------

    def remove(self, key: str) -> bool:
        """Remove ``key`` (and any put in progress for it); False if it was not there."""
        entry = self.objects.get(key) if isinstance(key, str) else None
        if entry is None:
            return False
        self._remove_entry(entry)
        return True

    def remove_all(self) -> int:
        count = len(self.objects)
        for entry in list(self.objects.values()):
            self._remove_entry(entry, publish=False)
        return count

    def _remove_entry(self, entry: ObjectEntry, publish: bool = True) -> None:
        now = self.clock()
        for replica in entry.replicas:
            self._release(entry, replica)
        if entry.pending is not None:  # the writer may still be copying: free after its deadline
            deadline = max(entry.pending.started_at + self.policy.put_timeout_s, now)
            for replica in entry.pending.replicas:
                assert replica.offset is not None
                self.retired.append((deadline, replica.segment, replica.offset))
        if entry.readable and publish:
            self.effects.events.append(BlockRemoved([key_to_hash(entry.key)]))
        self.disk.forget(entry)
        del self.objects[entry.key]
        self.lru.pop(entry.key, None)
        self.effects.dirty_objects.add(entry.key)

    def _release(self, entry: ObjectEntry, replica: Replica) -> None:
        """Give a replica's space back: DRAM at once or when the lease ends; DISK via the node."""
        if replica.medium is Medium.DISK:
            self.disk.drop_file(entry.key, replica)
            return
        assert replica.offset is not None
        if self.clock() < entry.lease_until:
            self.retired.append((entry.lease_until, replica.segment, replica.offset))
        else:
            self.segments.free(replica.segment, replica.offset)

    # -- eviction --------------------------------------------------------------------------------

    def over_watermark(self) -> bool:
        return self.segments.usage > self.policy.high_watermark

    def evict(self, target_bytes: int | None = None) -> list[str]:
        """Evict about ``eviction_ratio`` of the capacity (or ``target_bytes``), LRU first.

        Victims whose node has a disk tier with room move there (asynchronously, see
        :class:`DiskTier`); the others are removed. Returns the victims' keys in order.
        """
        if target_bytes is None:
            target_bytes = int(self.segments.capacity * self.policy.eviction_ratio)
        victims = choose_victims(
            self.lru, self.objects, self.clock(), max(target_bytes, 1), self.policy.alignment
        )
        removed: list[BlockHash] = []
        for key in victims:
            entry = self.objects[key]
            self.counters.evicted_bytes += sum(
                align_up(r.length, self.policy.alignment) for r in entry.dram_replicas()
            )
            if self.disk.start_offload(entry):
                continue
            self._remove_entry(entry, publish=False)
            removed.append(key_to_hash(key))
        if removed:
            self.effects.events.append(BlockRemoved(removed))
        self.counters.evicted_objects += len(victims)
        self.counters.eviction_rounds += 1
        return victims

    def next_release_at(self) -> float | None:
        """When DRAM held only by a lease is next released (a retired extent, or a leased object
        eviction could then take), or None if nothing is waiting on a lease."""
        now = self.clock()
        times = [t for t, _, _ in self.retired]
        for key in self.lru:
            entry = self.objects[key]
            if entry.lease_until > now and entry.dram_replicas():
                if (
                    entry.pending is None
                    and entry.busy is None
                    and not (entry.soft_pin and entry.pin_until > now)
                ):
                    times.append(entry.lease_until)
        return min(times, default=None)

    # -- housekeeping ----------------------------------------------------------------------------

    def sweep(self) -> None:
        """Drop silent nodes, reclaim abandoned puts, free retired space, evict past the watermark."""
        now = self.clock()
        for name in self.segments.expired(now, self.policy.node_ttl_s):
            self.drop_segment(name)
        for entry in [e for e in self.objects.values() if e.pending is not None]:
            assert entry.pending is not None
            if now - entry.pending.started_at > self.policy.put_timeout_s:
                self.counters.reclaimed_puts += 1
                self.put_revoke(entry.key, entry.pending.put_id)
        due = [r for r in self.retired if r[0] <= now]
        if due:
            self.retired = [r for r in self.retired if r[0] > now]
            for _, segment, offset in due:
                self.segments.free(segment, offset)
        if self.over_watermark():
            self.evict()

    # -- recovery --------------------------------------------------------------------------------

    def restore(self, segments: list[Segment], objects: list[ObjectEntry]) -> None:
        """Load persisted metadata into an empty state; replicas on unknown segments are dropped.

        Restored segments count as alive now: a node that does not heartbeat within the node TTL
        loses them as usual.
        """
        assert not self.objects and not len(self.segments)
        now = self.clock()
        for segment in segments:
            segment.last_seen = now
            self.segments.add(segment)
        for entry in sorted(objects, key=lambda e: e.created_at):
            keep: list[Replica] = []
            for replica in entry.replicas:
                if replica.segment not in self.segments:
                    continue
                if replica.medium is Medium.DRAM:
                    assert replica.offset is not None
                    self.segments.reserve(replica.segment, replica.offset, replica.length)
                else:
                    self.disk.restore(entry.key, replica)
                keep.append(replica)
            entry.replicas = keep
            if entry.pending is not None:
                pending = [r for r in entry.pending.replicas if r.segment in self.segments]
                for replica in pending:
                    assert replica.offset is not None
                    self.segments.reserve(replica.segment, replica.offset, replica.length)
                entry.pending.replicas = pending
                if not pending:
                    entry.pending = None
            if entry.replicas or entry.pending is not None:
                self.objects[entry.key] = entry
                if entry.readable:
                    self.lru[entry.key] = None

    # -- reporting -------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert that allocations and replicas agree (tests call this)."""
        self.segments.check()
        expected: dict[str, int] = {}
        for entry in self.objects.values():
            live = list(entry.replicas) + ([] if entry.pending is None else entry.pending.replicas)
            names = [r.segment for r in live if r.medium is Medium.DRAM]
            assert len(set(r.segment for r in entry.replicas)) == len(entry.replicas), (
                "replicas share a segment"
            )
            for replica in live:
                if replica.medium is Medium.DRAM:
                    assert replica.offset is not None
                    size = self.segments.allocators[replica.segment].allocated_size(replica.offset)
                    assert size == align_up(replica.length, self.policy.alignment), (
                        f"bad extent for {entry.key}"
                    )
            for name in names:
                expected[name] = expected.get(name, 0) + 1
        for _, segment, offset in self.retired:
            assert self.segments.allocators[segment].allocated_size(offset) is not None
            expected[segment] = expected.get(segment, 0) + 1
        self.disk.add_expected_allocations(expected)
        for name, allocator in self.segments.allocators.items():
            assert allocator.num_allocations == expected.get(name, 0), f"leaked allocations in {name}"
        assert list(self.lru) == [k for k in self.lru if self.objects[k].readable]
