"""The mounted segments and the space inside them.

Each segment owns one :class:`~yutu.store.allocator.RangeAllocator` over its region. Placement of
an object's replicas: one allocation on each of ``count`` distinct segments, most free bytes first
(ties by name), skipping segments that cannot fit it; fewer when fewer fit (best effort).
"""

from __future__ import annotations

from typing import Any

from yutu.store.allocator import RangeAllocator

from services.store_master.objects import Segment


class SegmentTable:
    """Only the master state mutates this table (it keeps objects and segments consistent)."""

    def __init__(self, alignment: int = 64) -> None:
        self.alignment = alignment
        self.segments: dict[str, Segment] = {}
        self.allocators: dict[str, RangeAllocator] = {}
        self._capacity = 0  # sum of the segments' sizes, kept by add/remove (read per put)
        self._largest = 0  # the largest segment's size, likewise
        self._used = 0  # bytes allocated in all segments, kept by every allocation and free

    def __contains__(self, name: str) -> bool:
        return name in self.segments

    def __len__(self) -> int:
        return len(self.segments)

    def get(self, name: str) -> Segment | None:
        return self.segments.get(name)

    def add(self, segment: Segment) -> None:
        assert segment.name not in self.segments
        self.segments[segment.name] = segment
        self.allocators[segment.name] = RangeAllocator(segment.size, self.alignment)
        self._sizes_changed()

    def remove(self, name: str) -> Segment:
        self._used -= self.allocators.pop(name).used_bytes
        segment = self.segments.pop(name)
        self._sizes_changed()
        return segment

    def _sizes_changed(self) -> None:
        sizes = [s.size for s in self.segments.values()]
        self._capacity, self._largest = sum(sizes), max(sizes, default=0)

    # -- space -----------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def usage(self) -> float:
        capacity = self.capacity
        return 0.0 if capacity == 0 else self.used_bytes / capacity

    @property
    def largest_segment(self) -> int:
        return self._largest

    def place(self, size: int, count: int, exclude: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """Allocate ``size`` bytes on up to ``count`` distinct segments: ``[(segment, offset)]``."""
        if count == 1:  # the common case: one pass for the segment ranked first, no sort
            best: str | None = None
            most = -1
            for name, allocator in self.allocators.items():
                free = allocator.free_bytes
                if (
                    free > most or (free == most and best is not None and name < best)
                ) and name not in exclude:
                    best, most = name, free
            if best is not None:
                offset = self._allocate(self.allocators[best], size)
                if offset is not None:
                    return [(best, offset)]
        ranked = sorted(
            (n for n in self.segments if n not in exclude), key=lambda n: (-self.allocators[n].free_bytes, n)
        )
        placed: list[tuple[str, int]] = []
        for name in ranked:
            if len(placed) == count:
                break
            offset = self._allocate(self.allocators[name], size)
            if offset is not None:
                placed.append((name, offset))
        return placed

    def allocate_on(self, name: str, size: int) -> int | None:
        return self._allocate(self.allocators[name], size)

    def _allocate(self, allocator: RangeAllocator, size: int) -> int | None:
        offset = allocator.allocate(size)
        if offset is not None:
            self._used += allocator.allocated_size(offset) or 0
        return offset

    def can_fit(self, size: int) -> bool:
        return any(a.can_allocate(size) for a in self.allocators.values())

    def free(self, name: str, offset: int) -> None:
        """Free an allocation; a no-op when the segment is gone (its allocator went with it)."""
        allocator = self.allocators.get(name)
        if allocator is not None:
            self._used -= allocator.free(offset)

    def reserve(self, name: str, offset: int, length: int) -> None:
        allocator = self.allocators[name]
        allocator.reserve(offset, length)
        self._used += allocator.allocated_size(offset) or 0

    # -- liveness --------------------------------------------------------------------------------

    def expired(self, now: float, ttl_s: float) -> list[str]:
        """Segments whose node has not been heard from for more than ``ttl_s``."""
        return sorted(n for n, s in self.segments.items() if now - s.last_seen > ttl_s)

    # -- reporting -------------------------------------------------------------------------------

    def describe(self, name: str) -> dict[str, Any]:
        s, a = self.segments[name], self.allocators[name]
        return {
            "segment": s.name,
            "region": s.region,
            "node_id": s.node_id,
            "host_id": s.host_id,
            "incarnation": s.incarnation,
            "capacity": s.size,
            "used": a.used_bytes,
            "free": a.free_bytes,
            "allocations": a.num_allocations,
            "free_ranges": a.num_free_ranges,
            "largest_free": a.largest_free,
            "fragmentation": round(a.fragmentation, 6),
            "disk_capacity": s.disk_capacity,
            "disk_used": s.disk_used,
            "last_seen": s.last_seen,
            "mounted_at": s.mounted_at,
        }

    def fragmentation(self) -> float:
        """Free-byte-weighted mean fragmentation of all segments."""
        free = sum(a.free_bytes for a in self.allocators.values())
        if free == 0:
            return 0.0
        return sum(a.fragmentation * a.free_bytes for a in self.allocators.values()) / free

    def check(self) -> None:
        for allocator in self.allocators.values():
            allocator.check()
        assert self._used == sum(a.used_bytes for a in self.allocators.values()), "used bytes drifted"
