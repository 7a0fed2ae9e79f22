"""The eviction order: a pluggable :mod:`yutu.evict` policy kept in step with the master's objects.

Every readable object with DRAM replicas is in the policy, sized by its DRAM footprint (aligned
bytes of its DRAM replicas); a put_end or a promotion inserts it, a read accesses it, an offload, a
removal or the loss of its last DRAM replica removes it. Victims are never protected objects (see
:meth:`~services.store_master.objects.ObjectEntry.protection`).
"""

from __future__ import annotations

from collections.abc import Mapping

from yutu.evict import make_policy
from yutu.evict.policy import Resizable
from yutu.store.allocator import align_up

from services.store_master.objects import ObjectEntry


def dram_footprint(entry: ObjectEntry, alignment: int) -> int:
    """Bytes of segment memory the object's DRAM replicas hold."""
    return sum(align_up(r.length, alignment) for r in entry.dram_replicas())


class EvictionOrder:
    """The eviction policy over the objects that hold DRAM, in bytes of DRAM footprint."""

    def __init__(self, policy: str, alignment: int) -> None:
        self.name = policy
        self.policy = make_policy(policy, 1)  # capacity follows the mounted segments (resize)
        self.alignment = alignment
        # a reader leased the key's DRAM replicas: the policy's access, bound once (every get)
        self.read = self.policy.access

    def capacity_changed(self, capacity: int) -> None:
        if isinstance(self.policy, Resizable):
            self.policy.resize(max(capacity, 1))

    def stored(self, entry: ObjectEntry) -> None:
        """``entry`` got new DRAM replicas (put_end, promotion, recovery): a use, at its new size."""
        footprint = dram_footprint(entry, self.alignment)
        if footprint:
            self.policy.insert(entry.key, footprint)
        else:
            self.policy.remove(entry.key)

    def refit(self, entry: ObjectEntry) -> None:
        """``entry`` lost some DRAM replicas (a segment went away): it re-enters at its new size as
        a new key (the interface has no resize of one key), or leaves if it has no DRAM left."""
        self.policy.remove(entry.key)
        footprint = dram_footprint(entry, self.alignment)
        if footprint:
            self.policy.insert(entry.key, footprint)

    def gone(self, key: str) -> None:
        """``key`` holds no DRAM any more (removed, offloaded, lost)."""
        self.policy.remove(key)

    def victims(self, objects: Mapping[str, ObjectEntry], now: float, target_bytes: int) -> list[str]:
        """Keys to evict, in eviction order, until their DRAM footprint reaches ``target_bytes``;
        fewer when too much is protected."""
        return self.policy.victims(target_bytes, lambda key: objects[key].protection(now) is not None)

    def check(self, objects: Mapping[str, ObjectEntry]) -> None:
        """Assert that the policy holds exactly the readable objects with DRAM, at their footprints."""
        holding = {k: dram_footprint(e, self.alignment) for k, e in objects.items() if e.readable}
        holding = {k: size for k, size in holding.items() if size}
        assert len(self.policy) == len(holding), "the eviction order and the objects disagree"
        assert all(k in self.policy for k in holding), (
            "an object with DRAM is missing from the eviction order"
        )
        assert self.policy.used == sum(holding.values()), "the eviction order's sizes are stale"
