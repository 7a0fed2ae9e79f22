"""Adaptive: an ARC-like split between a recency part (LRU) and a frequency part (LFU).

Parts (sizes in the caller's units; ``capacity`` is the cache's size in the same units):

- ``T1``, the recency part, LRU-ordered: resident keys used once (inserted, not accessed since);
- ``T2``, the frequency part, LFU-ordered (see :mod:`yutu.evict.lfu`): resident keys used twice or
  more, and keys that came back from a ghost list;
- ``B1`` / ``B2``, ghost lists: keys recently *evicted* from T1 / T2 (no data, just key, size and,
  for B2, the use count), oldest first. Each holds at most ``capacity`` units: adding a ghost drops
  that list's oldest ghosts past it.
- ``target``, the share of the capacity T1 should hold: an int in ``[0, capacity]``, starting at 0.

The rules, exactly:

- ``insert(k, s)`` of a new key: if ``k`` is in B1 (T1 was too small to keep it), ``target +=
  s * max(1, B2.used // B1.used)`` (capped at ``capacity``); if in B2 (T2 was too small),
  ``target -= s * max(1, B1.used // B2.used)`` (floored at 0) -- both computed before ``k`` leaves
  its ghost list. A ghost comes back into T2 with its old count + 1 (a B1 ghost's old count is 1);
  any other new key goes into T1.
- ``insert`` of a resident key is an access (with the new size); ``access`` moves a T1 key to T2
  (count 2) and counts a T2 key once more.
- ``victims(need, protected)`` walks both parts' eviction orders, skipping protected keys: while
  what it has chosen is short of ``need``, the next victim comes from T1 if T1's size minus the
  T1 victims chosen so far is above ``target``, else from T2; from the other part when that one
  has no unprotected key left.
- ``remove(k)`` of a key that a ``victims`` answer proposed since its last insert or access is an
  eviction: ``k`` becomes the newest ghost of B1 (from T1) or B2 (from T2). Any other ``remove``
  (a delete) leaves no ghost. A cache evicts before it inserts, so the eviction that makes room
  for a key can push that key's own ghost out of a full ghost list (then it comes back as new).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from yutu.evict.lfu import LFU
from yutu.evict.lru import LRU
from yutu.evict.policy import check_size, never_protected


class Ghosts:
    """Evicted keys (size, use count), oldest first, at most ``capacity`` units in all."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.used = 0

    def add(self, key: str, size: int, count: int) -> None:
        self._entries[key] = (size, count)
        self.used += size
        self.resize(self.capacity)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        while self.used > self.capacity:
            _, (old_size, _) = self._entries.popitem(last=False)
            self.used -= old_size

    def pop(self, key: str) -> int:
        """Forget ``key``; answer its use count."""
        size, count = self._entries.pop(key)
        self.used -= size
        return count

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


class Adaptive:
    """The ARC-like policy (rules in the module docstring)."""

    name = "adaptive"

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"the adaptive policy needs a positive capacity (cache size), got {capacity!r}")
        self.capacity = capacity
        self.target = 0
        self.recent = LRU()  # T1
        self.frequent = LFU()  # T2
        self.recent_ghosts = Ghosts(capacity)  # B1
        self.frequent_ghosts = Ghosts(capacity)  # B2
        self._proposed: set[str] = set()  # resident keys proposed as victims since their last use

    def resize(self, capacity: int) -> None:
        """The cache's capacity changed (a store mounted or lost memory): the target and the ghost
        lists follow it (the target is capped, the ghost lists drop their oldest past it)."""
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"the adaptive policy needs a positive capacity (cache size), got {capacity!r}")
        self.capacity = capacity
        self.target = min(self.target, capacity)
        for ghosts in (self.recent_ghosts, self.frequent_ghosts):
            ghosts.resize(capacity)

    def insert(self, key: str, size: int = 1) -> None:
        check_size(size)
        self._proposed.discard(key)
        if key in self.recent or key in self.frequent:
            self._touch(key, size)
        elif key in self.recent_ghosts:
            b1, b2 = self.recent_ghosts.used, self.frequent_ghosts.used
            self.target = min(self.capacity, self.target + size * max(1, b2 // b1))
            self.frequent.insert(key, size, count=self.recent_ghosts.pop(key) + 1)
        elif key in self.frequent_ghosts:
            b1, b2 = self.recent_ghosts.used, self.frequent_ghosts.used
            self.target = max(0, self.target - size * max(1, b1 // b2))
            self.frequent.insert(key, size, count=self.frequent_ghosts.pop(key) + 1)
        else:
            self.recent.insert(key, size)

    def access(self, key: str) -> None:
        if key not in self.recent and key not in self.frequent:
            raise KeyError(key)
        self._proposed.discard(key)
        self._touch(key, None)

    def _touch(self, key: str, size: int | None) -> None:
        if key in self.recent:
            old = self.recent.size_of(key)
            self.recent.remove(key)
            self.frequent.insert(key, size or old, count=2)
        elif size is None:
            self.frequent.access(key)
        else:
            self.frequent.insert(key, size)  # resident: an access with the new size

    def remove(self, key: str) -> None:
        evicted = key in self._proposed
        self._proposed.discard(key)
        if key in self.recent:
            size = self.recent.size_of(key)
            self.recent.remove(key)
            if evicted:
                self.recent_ghosts.add(key, size, 1)
        elif key in self.frequent:
            size, count = self.frequent.size_of(key), self.frequent.count_of(key)
            self.frequent.remove(key)
            if evicted:
                self.frequent_ghosts.add(key, size, count)

    def victims(self, need: int, protected: Callable[[str], bool] = never_protected) -> list[str]:
        chosen: list[str] = []
        freed = 0
        recent_left = self.recent.used
        t1 = _unprotected(self.recent.order(), protected)
        t2 = _unprotected(self.frequent.order(), protected)
        head1, head2 = next(t1, None), next(t2, None)
        while freed < need and (head1 is not None or head2 is not None):
            if head1 is not None and (recent_left > self.target or head2 is None):
                key, size = head1
                recent_left -= size
                head1 = next(t1, None)
            else:
                assert head2 is not None
                key, size = head2
                head2 = next(t2, None)
            chosen.append(key)
            freed += size
        self._proposed.update(chosen)
        return chosen

    def __contains__(self, key: object) -> bool:
        return key in self.recent or key in self.frequent

    def __len__(self) -> int:
        return len(self.recent) + len(self.frequent)

    @property
    def used(self) -> int:
        return self.recent.used + self.frequent.used


def _unprotected(
    order: Iterator[tuple[str, int]], protected: Callable[[str], bool]
) -> Iterator[tuple[str, int]]:
    return ((key, size) for key, size in order if not protected(key))
