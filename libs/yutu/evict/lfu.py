"""Least frequently used: evict the key with the fewest uses (its insert plus its accesses).

A key's count starts at 1 on insert and grows by 1 on each access (or re-insert); it is forgotten
when the key is removed (no aging, no history). Among keys with equal counts the one that reached
that count first goes first -- for keys never accessed since their insert, that is insertion order
(oldest first); for the others it is least recently accessed first.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterator

from yutu.evict.lru import take
from yutu.evict.policy import check_size, never_protected


class LFU:
    """Keys bucketed by count; each bucket keeps arrival order. ``order()`` is the eviction order."""

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._size: dict[str, int] = {}
        self._buckets: dict[int, OrderedDict[str, None]] = {}  # count -> keys, first arrived first
        self._counts: list[int] = []  # the buckets' counts, ascending (kept with bisect)
        self._used = 0

    def insert(self, key: str, size: int = 1, count: int = 1) -> None:
        """As the interface's ``insert``; ``count`` sets a new key's starting count (the adaptive
        policy gives a key coming back from its ghost list the count it had)."""
        check_size(size)
        if key in self._count:
            self._used += size - self._size[key]
            self._size[key] = size
            self.access(key)
            return
        if count < 1:
            raise ValueError(f"a key's use count starts at 1 or more, got {count}")
        self._count[key] = count
        self._size[key] = size
        self._used += size
        self._enter(key, count)

    def access(self, key: str) -> None:
        count = self._count[key]  # KeyError for a key that is not resident
        self._leave(key, count)
        self._count[key] = count + 1
        self._enter(key, count + 1)

    def remove(self, key: str) -> None:
        count = self._count.pop(key, None)
        if count is None:
            return
        self._leave(key, count)
        self._used -= self._size.pop(key)

    def count_of(self, key: str) -> int:
        return self._count[key]

    def size_of(self, key: str) -> int:
        return self._size[key]

    def order(self) -> Iterator[tuple[str, int]]:
        """(key, size) in eviction order. Do not change the policy while iterating."""
        for count in self._counts:
            for key in self._buckets[count]:
                yield key, self._size[key]

    def victims(self, need: int, protected: Callable[[str], bool] = never_protected) -> list[str]:
        return take(self.order(), need, protected)

    def _enter(self, key: str, count: int) -> None:
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
            bisect.insort(self._counts, count)
        bucket[key] = None

    def _leave(self, key: str, count: int) -> None:
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            del self._counts[bisect.bisect_left(self._counts, count)]

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def __len__(self) -> int:
        return len(self._count)

    @property
    def used(self) -> int:
        return self._used
