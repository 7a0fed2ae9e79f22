"""Which segments the master holds and whether their nodes are alive: mount, unmount, heartbeat,
and dropping a segment with every replica on it (a lost node, a restarted one, an unmount)."""

from __future__ import annotations

from collections.abc import Sequence

from yutu.protocol.kv_events import BlockRemoved, key_to_hash
from yutu.store.types import Medium

from services.store_master.objects import ObjectEntry, Segment
from services.store_master.state_core import StateCore, bad_request, check_int


class Membership:
    """Segment membership over the master's tables (``core``); only the master state calls it."""

    def __init__(self, core: StateCore) -> None:
        self.core = core

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
                raise bad_request(f"{label} must be a non-empty str, got {value!r}")
        check_int("size", size, 1)
        check_int("incarnation", incarnation)
        check_int("disk_capacity", disk_capacity)
        now = self.core.clock()
        existing = self.core.segments.get(name)
        if existing is not None:
            if existing.incarnation == incarnation and existing.size == size and existing.region == region:
                existing.last_seen = now
                existing.node_id = node_id
                return False
            self.drop_segment(name)  # the node restarted: what the old incarnation held is gone
        segment = Segment(name, region, size, host_id, node_id, incarnation, disk_capacity, 0, now, now)
        self.core.segments.add(segment)
        self.core.eviction.capacity_changed(self.core.segments.capacity)
        self.core.effects.dirty_segments.add(name)
        return True

    def unmount(self, node_id: str, name: str) -> int:
        """Unmount a segment of ``node_id``; returns how many replicas were dropped with it."""
        if not isinstance(name, str):
            raise bad_request(f"segment must be a str, got {name!r}")
        segment = self.core.segments.get(name)
        if segment is None:
            return 0
        if segment.node_id != node_id:
            raise bad_request(f"segment {name!r} is mounted by {segment.node_id!r}, not {node_id!r}")
        return self.drop_segment(name)

    def heartbeat(self, node_id: str, segments: Sequence[tuple[str, int]]) -> list[str]:
        """Refresh liveness; returns the listed segments the master does not know (to remount)."""
        now = self.core.clock()
        remount: list[str] = []
        for name, incarnation in segments:
            segment = self.core.segments.get(name)
            if segment is None or segment.incarnation != incarnation:
                remount.append(name)
            else:
                segment.last_seen = now
        return remount

    def drop_segment(self, name: str) -> int:
        """Forget a segment and every replica on it; objects left without replicas are removed."""
        dropped = 0
        for key in [k for k, e in self.core.objects.items() if self._touches(e, name)]:
            entry = self.core.objects[key]
            before = len(entry.replicas)
            lost_dram = any(r.segment == name and r.medium is Medium.DRAM for r in entry.replicas)
            entry.replicas = tuple(r for r in entry.replicas if r.segment != name)
            dropped += before - len(entry.replicas)
            if entry.pending is not None:
                kept = tuple(r for r in entry.pending.replicas if r.segment != name)
                dropped += len(entry.pending.replicas) - len(kept)
                entry.pending.replicas = kept
                if not kept:
                    entry.pending = None  # its writer's put_end will be told the put is gone
            if lost_dram:
                self.core.eviction.refit(entry)
            if not entry.replicas:
                if before:
                    self.core.counters.lost_objects += 1
                    self.core.effects.events.append(BlockRemoved([key_to_hash(key)]))
                if entry.pending is None:
                    del self.core.objects[key]
            self.core.effects.dirty_objects.add(key)
        for put_id in [i for i, r in self.core.reserved.items() if r.replicas[0].segment == name]:
            del self.core.reserved[put_id]  # its writer's commit will be told it is gone
            dropped += 1
        self.core.retired = [r for r in self.core.retired if r[1] != name]
        self.core.disk.segment_dropped(name)
        self.core.segments.remove(name)
        self.core.eviction.capacity_changed(self.core.segments.capacity)
        self.core.effects.dirty_segments.add(name)
        return dropped

    @staticmethod
    def _touches(entry: ObjectEntry, segment: str) -> bool:
        if any(r.segment == segment for r in entry.replicas):
            return True
        return entry.pending is not None and any(r.segment == segment for r in entry.pending.replicas)
