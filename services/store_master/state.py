"""The store master's metadata: segments, objects, replicas, puts, leases, pins and eviction.

Every operation is synchronous and runs on the event loop, so each one is atomic with respect to
the others; nothing here does I/O. What an operation means for the outside world is collected in
``effects`` (objects and segments to persist, KV events to publish, disk-tier tasks to hand to
nodes) and taken by the service after each call with :meth:`MasterState.take_effects`
(:class:`~services.store_master.settle.Settler`).

Time is wall-clock seconds from the injected ``clock`` (tests pass a fake one). Space that a reader
may still be copying (leased replicas) or a writer may still be filling (a removed put) is not
freed at once but *retired* until the lease or the put deadline has passed.

:class:`MasterState` is the tables of :class:`~services.store_master.state_core.StateCore` (objects,
segments and their allocators, the eviction order, retired space, the disk tier, effects, counters
and removal) and the parts that work on them, each given the tables: ``membership``
(:mod:`~services.store_master.liveness`: segments and their nodes), ``puts``
(:mod:`~services.store_master.puts`) and ``evictor`` (:mod:`~services.store_master.eviction`).
Its methods are the operations the handlers call; reads, the sweep, recovery and the integrity
check are here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from yutu.errors import ErrorKind, YutuError
from yutu.store.allocator import align_up
from yutu.store.types import Medium

from services.store_master.eviction import Evictor
from services.store_master.liveness import Membership
from services.store_master.objects import ObjectEntry, Replica, Segment
from services.store_master.puts import Puts
from services.store_master.state_core import (
    Counters,
    Effects,
    NoSpaceError,
    StateCore,
    StatePolicy,
    check_int,
)

__all__ = ["Counters", "Effects", "MasterState", "NoSpaceError", "StateCore", "StatePolicy", "check_int"]


class MasterState(StateCore):
    """All of the master's metadata and the operations on it (see the module docstring)."""

    def __init__(self, policy: StatePolicy, clock: Callable[[], float] = time.time) -> None:
        super().__init__(policy, clock)
        self.membership = Membership(self)
        self.puts = Puts(self)
        self.evictor = Evictor(self)
        # the parts' operations, as the state's own (bound once: put_start and put_end are hot)
        self.mount = self.membership.mount
        self.unmount = self.membership.unmount
        self.heartbeat = self.membership.heartbeat
        self.drop_segment = self.membership.drop_segment
        self.put_start = self.puts.put_start
        self.put_end = self.puts.put_end
        self.put_revoke = self.puts.put_revoke
        self.reserve = self.puts.reserve
        self.commit = self.puts.commit
        self.unreserve = self.puts.unreserve
        self.over_watermark = self.evictor.over_watermark
        self.evict = self.evictor.evict
        self.next_release_at = self.evictor.next_release_at

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
        self.eviction.read(key)
        return entry.size, dram

    def exists(self, key: str) -> bool:
        entry = self.objects.get(key) if isinstance(key, str) else None
        return entry is not None and entry.readable

    # -- housekeeping ----------------------------------------------------------------------------

    def sweep(self) -> None:
        """Drop silent nodes, reclaim abandoned puts and reservations, free retired space, evict past
        the watermark."""
        now = self.clock()
        for name in self.segments.expired(now, self.policy.node_ttl_s):
            self.drop_segment(name)
        for entry in [e for e in self.objects.values() if e.pending is not None]:
            assert entry.pending is not None
            if now - entry.pending.started_at > self.policy.put_timeout_s:
                self.counters.reclaimed_puts += 1
                self.put_revoke(entry.key, entry.pending.put_id)
        for put_id in [i for i, r in self.reserved.items() if now - r.started_at > self.policy.put_timeout_s]:
            self.counters.reclaimed_puts += 1
            self.unreserve(put_id)
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
        assert not self.objects and not self.reserved and not len(self.segments)
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
            entry.replicas = tuple(keep)
            if entry.pending is not None:
                pending = tuple(r for r in entry.pending.replicas if r.segment in self.segments)
                for replica in pending:
                    assert replica.offset is not None
                    self.segments.reserve(replica.segment, replica.offset, replica.length)
                entry.pending.replicas = pending
                if not pending:
                    entry.pending = None
            if entry.replicas or entry.pending is not None:
                self.objects[entry.key] = entry
                if entry.readable:
                    self.eviction.stored(entry)
        self.eviction.capacity_changed(self.segments.capacity)

    # -- reporting -------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert that allocations and replicas agree (tests call this)."""
        self.segments.check()
        expected: dict[str, int] = {}
        for entry in self.objects.values():
            live = entry.replicas + (() if entry.pending is None else entry.pending.replicas)
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
        for reservation in self.reserved.values():
            (replica,) = reservation.replicas
            assert replica.offset is not None
            size = self.segments.allocators[replica.segment].allocated_size(replica.offset)
            assert size == align_up(replica.length, self.policy.alignment), (
                f"bad extent for {reservation.put_id}"
            )
            expected[replica.segment] = expected.get(replica.segment, 0) + 1
        for _, segment, offset in self.retired:
            assert self.segments.allocators[segment].allocated_size(offset) is not None
            expected[segment] = expected.get(segment, 0) + 1
        self.disk.add_expected_allocations(expected)
        for name, allocator in self.segments.allocators.items():
            assert allocator.num_allocations == expected.get(name, 0), f"leaked allocations in {name}"
        self.eviction.check(self.objects)
