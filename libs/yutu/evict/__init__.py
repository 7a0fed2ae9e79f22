"""Pure eviction policies: which resident keys to evict, in which order.

No I/O, no clock, no asyncio: importable by the store master and by a cluster simulator alike.
The calling protocol is in :mod:`yutu.evict.policy`; the policies are

- ``lru`` (:mod:`yutu.evict.lru`): least recently inserted-or-accessed first (the store's default);
- ``lfu`` (:mod:`yutu.evict.lfu`): fewest uses first, ties oldest first;
- ``adaptive`` (:mod:`yutu.evict.adaptive`): an ARC-like split between an LRU part and an LFU part,
  with ghost lists shifting the split toward the part whose evictions were wrong.

``make_policy(name, capacity)`` builds one; ``capacity`` is the cache's size in the units the
caller gives sizes in (only the adaptive policy uses it).
"""

from __future__ import annotations

from yutu.evict.adaptive import Adaptive
from yutu.evict.lfu import LFU
from yutu.evict.lru import LRU
from yutu.evict.policy import EvictionPolicy

POLICIES: tuple[str, ...] = ("lru", "lfu", "adaptive")


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A fresh policy called ``name`` for a cache of ``capacity`` units; :class:`ValueError` for an
    unknown name (listing :data:`POLICIES`) or a capacity that is not a positive int."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        raise ValueError(
            f"the cache capacity must be a positive int (in the units of sizes), got {capacity!r}"
        )
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "adaptive":
        return Adaptive(capacity)
    raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "EvictionPolicy", "make_policy"]
