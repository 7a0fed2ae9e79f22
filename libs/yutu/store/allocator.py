"""An offset allocator over one contiguous byte range: best fit, with coalescing of free ranges.

Used by the store master (space inside every mounted segment) and by the client (its staging
buffer). Sizes are rounded up to ``alignment``; a range is handed out from the start of the
smallest free range that fits it, ties broken by the lowest offset, so placement is deterministic::

    capacity 1024, alignment 64
    allocate(100) -> 0     [0,128) used       [128,1024) free
    allocate(64)  -> 128   [128,192) used     [192,1024) free
    free(0)                [0,128) free  [128,192) used  [192,1024) free
    allocate(64)  -> 0     best fit: the 128-byte hole, not the 832-byte tail
    free(128)              coalesces with its free neighbours into [64,1024)

``allocate`` returns None when nothing fits (the caller evicts or refuses); freeing an offset that
was not allocated raises :class:`AllocatorError` (a caller bug). ``check()`` verifies the
invariants: ranges disjoint and inside the capacity, free ranges fully coalesced,
``used + free == capacity``.
"""

from __future__ import annotations

from bisect import bisect_left, insort


class AllocatorError(ValueError):
    """An offset or size the allocator cannot accept (not allocated, overlapping, out of range)."""


def align_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


class RangeAllocator:
    """Best-fit allocator of ``[0, capacity)``. Not thread-safe; one owner mutates it."""

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity = capacity
        self.alignment = alignment
        self._free_at: dict[int, int] = {}  # free range start -> size
        self._free_end: dict[int, int] = {}  # free range end -> start
        self._by_size: list[tuple[int, int]] = []  # (size, start) of every free range, sorted
        self._used: dict[int, int] = {}  # allocated start -> aligned size
        self.used_bytes = 0
        self._add_free(0, capacity)

    # -- queries ---------------------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def num_allocations(self) -> int:
        return len(self._used)

    @property
    def num_free_ranges(self) -> int:
        return len(self._free_at)

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def fragmentation(self) -> float:
        """``1 - largest free range / free bytes``: 0 when all free space is one range."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def allocated_size(self, offset: int) -> int | None:
        """The aligned size of the allocation starting at ``offset``, or None."""
        return self._used.get(offset)

    def can_allocate(self, size: int) -> bool:
        return self.largest_free >= align_up(size, self.alignment)

    def free_ranges(self) -> list[tuple[int, int]]:
        """Every free range as ``(start, size)``, by start offset."""
        return sorted(self._free_at.items())

    # -- mutation --------------------------------------------------------------------------------

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes (rounded up to the alignment); the offset, or None if nothing fits."""
        if size <= 0:
            raise AllocatorError(f"allocation size must be positive, got {size}")
        need = align_up(size, self.alignment)
        i = bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        free_size, start = self._by_size[i]
        self._remove_free(start, free_size, index=i)
        if free_size > need:
            self._add_free(start + need, free_size - need)
        self._used[start] = need
        self.used_bytes += need
        return start

    def reserve(self, offset: int, size: int) -> None:
        """Mark ``[offset, offset + size)`` (size rounded up) as allocated, e.g. when recovering.

        Raises :class:`AllocatorError` unless the whole range is free and ``offset`` is aligned.
        """
        need = align_up(size, self.alignment)
        if size <= 0 or offset < 0 or offset % self.alignment or offset + need > self.capacity:
            raise AllocatorError(
                f"cannot reserve [{offset}, {offset + need}) in a {self.capacity}-byte range"
            )
        for start, free_size in self._free_at.items():
            if start <= offset and offset + need <= start + free_size:
                break
        else:
            raise AllocatorError(f"[{offset}, {offset + need}) overlaps an allocated range")
        self._remove_free(start, free_size)
        if offset > start:
            self._add_free(start, offset - start)
        end, free_end = offset + need, start + free_size
        if free_end > end:
            self._add_free(end, free_end - end)
        self._used[offset] = need
        self.used_bytes += need

    def free(self, offset: int) -> int:
        """Release the allocation starting at ``offset``; returns its (aligned) size."""
        size = self._used.pop(offset, None)
        if size is None:
            raise AllocatorError(f"offset {offset} is not the start of an allocated range")
        self.used_bytes -= size
        start, end = offset, offset + size
        next_size = self._free_at.get(end)
        if next_size is not None:  # [start, end) + [end, end + next_size)
            self._remove_free(end, next_size)
            end += next_size
        prev_start = self._free_end.get(start)
        if prev_start is not None:  # [prev_start, start) + [start, end)
            self._remove_free(prev_start, start - prev_start)
            start = prev_start
        self._add_free(start, end - start)
        return size

    def check(self) -> None:
        """Assert the allocator's invariants (tests and debug endpoints call this)."""
        ranges = [(s, n, "free") for s, n in self._free_at.items()]
        ranges += [(s, n, "used") for s, n in self._used.items()]
        ranges.sort()
        cursor = 0
        previous_kind = ""
        for start, size, kind in ranges:
            assert size > 0 and start == cursor, f"gap or overlap at {start} (expected {cursor})"
            assert not (kind == "free" and previous_kind == "free"), f"uncoalesced free ranges at {start}"
            cursor, previous_kind = start + size, kind
        assert cursor == self.capacity, f"ranges end at {cursor}, capacity is {self.capacity}"
        assert self.used_bytes == sum(self._used.values())
        assert self.used_bytes + sum(self._free_at.values()) == self.capacity
        assert self._by_size == sorted((n, s) for s, n in self._free_at.items())
        assert self._free_end == {s + n: s for s, n in self._free_at.items()}

    # -- internals -------------------------------------------------------------------------------

    def _add_free(self, start: int, size: int) -> None:
        self._free_at[start] = size
        self._free_end[start + size] = start
        insort(self._by_size, (size, start))

    def _remove_free(self, start: int, size: int, index: int | None = None) -> None:
        del self._free_at[start]
        del self._free_end[start + size]
        if index is None:
            index = bisect_left(self._by_size, (size, start))
        assert self._by_size[index] == (size, start)
        del self._by_size[index]
