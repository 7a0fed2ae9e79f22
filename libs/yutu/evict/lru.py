"""Least recently used: evict the key whose last insert or access is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from yutu.evict.policy import check_size, never_protected


class LRU:
    """Keys in recency order (oldest first) with their sizes.

    ``order()`` is the eviction order: least recently inserted-or-accessed first.
    """

    name = "lru"
    # A hit on a resident key (KeyError for one that is not): the order's move_to_end itself,
    # bound in __init__ -- the store master calls it on every get of every key.
    access: Callable[[str], None]

    def __init__(self) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict()  # oldest first
        self._used = 0
        self.access = self._sizes.move_to_end

    def insert(self, key: str, size: int = 1) -> None:
        check_size(size)
        old = self._sizes.get(key)
        if old is not None:
            self._used -= old
            self._sizes.move_to_end(key)
        self._sizes[key] = size
        self._used += size

    def remove(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size

    def size_of(self, key: str) -> int:
        return self._sizes[key]

    def order(self) -> Iterator[tuple[str, int]]:
        """(key, size) in eviction order. Do not change the policy while iterating."""
        return iter(self._sizes.items())

    def victims(self, need: int, protected: Callable[[str], bool] = never_protected) -> list[str]:
        return take(self.order(), need, protected)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def used(self) -> int:
        return self._used


def take(order: Iterator[tuple[str, int]], need: int, protected: Callable[[str], bool]) -> list[str]:
    """The first unprotected keys of ``order`` whose sizes reach ``need`` (all of them if they don't)."""
    chosen: list[str] = []
    freed = 0
    if need <= 0:
        return chosen
    for key, size in order:
        if protected(key):
            continue
        chosen.append(key)
        freed += size
        if freed >= need:
            break
    return chosen
