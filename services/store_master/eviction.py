"""Eviction: which objects to evict (least recently accessed first, never a protected one), and
evicting them from the master's state.

:func:`choose_victims` is pure policy over the master's records, so tests can pin exact victim
lists. An object is protected while it is leased (a reader may be copying it), being written (a put
or upsert in progress), soft-pinned (until the pin's TTL runs out) or busy with a disk-tier task.
:class:`Eviction` applies it: victims move to a disk tier or are removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from yutu.protocol.kv_events import BlockHash, BlockRemoved, key_to_hash
from yutu.store.allocator import align_up

from services.store_master.objects import ObjectEntry
from services.store_master.state_core import StateCore


def dram_footprint(entry: ObjectEntry, alignment: int) -> int:
    """Bytes of segment memory the object's DRAM replicas hold."""
    return sum(align_up(r.length, alignment) for r in entry.dram_replicas())


def choose_victims(
    lru_order: Iterable[str],
    objects: Mapping[str, ObjectEntry],
    now: float,
    target_bytes: int,
    alignment: int,
) -> list[str]:
    """Keys to evict, in eviction order, until their DRAM footprint reaches ``target_bytes``.

    ``lru_order`` lists keys least recently accessed first. Objects without DRAM replicas (only on
    disk) free nothing and are skipped. Returns fewer bytes' worth when too much is protected.
    """
    victims: list[str] = []
    freed = 0
    for key in lru_order:
        if freed >= target_bytes:
            break
        entry = objects[key]
        footprint = dram_footprint(entry, alignment)
        if footprint == 0 or entry.protection(now) is not None:
            continue
        victims.append(key)
        freed += footprint
    return victims


class Eviction(StateCore):
    """Mixin of :class:`~services.store_master.state.MasterState`: evicting past the watermark or
    to make room."""

    def over_watermark(self) -> bool:
        return self.segments.usage > self.policy.high_watermark

    def evict(self, target_bytes: int | None = None) -> list[str]:
        """Evict about ``eviction_ratio`` of the capacity (or ``target_bytes``), LRU first.

        Victims whose node has a disk tier with room move there (asynchronously, see
        :class:`~services.store_master.disk_tier.DiskTier`); the others are removed. Returns the victims' keys in order.
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
