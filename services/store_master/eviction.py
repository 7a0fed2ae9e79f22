"""Eviction: evicting the victims the eviction order names (a pluggable :mod:`yutu.evict`
policy, see :mod:`services.store_master.eviction_order`) from the master's state.

An object is protected while it is leased (a reader may be copying it), being written (a put or
upsert in progress), soft-pinned (until the pin's TTL runs out) or busy with a disk-tier task.
Victims move to a disk tier or are removed.
"""

from __future__ import annotations

from yutu.protocol.kv_events import BlockHash, BlockRemoved, key_to_hash

from services.store_master.eviction_order import dram_footprint
from services.store_master.state_core import StateCore


class Evictor:
    """Evicting past the watermark or to make room, over the master's tables (``core``)."""

    def __init__(self, core: StateCore) -> None:
        self.core = core

    def over_watermark(self) -> bool:
        return self.core.segments.usage > self.core.policy.high_watermark

    def evict(self, target_bytes: int | None = None) -> list[str]:
        """Evict about ``eviction_ratio`` of the capacity (or ``target_bytes``) in the policy's order.

        Victims whose node has a disk tier with room move there (asynchronously, see
        :class:`~services.store_master.disk_tier.DiskTier`); the others are removed. Returns the victims' keys in order.
        """
        if target_bytes is None:
            target_bytes = int(self.core.segments.capacity * self.core.policy.eviction_ratio)
        victims = self.core.eviction.victims(self.core.objects, self.core.clock(), max(target_bytes, 1))
        removed: list[BlockHash] = []
        for key in victims:
            entry = self.core.objects[key]
            self.core.counters.evicted_bytes += dram_footprint(entry, self.core.policy.alignment)
            if self.core.disk.start_offload(entry):
                continue
            self.core.remove_entry(entry, publish=False)
            removed.append(key_to_hash(key))
        if removed:
            self.core.effects.events.append(BlockRemoved(removed))
        self.core.counters.evicted_objects += len(victims)
        self.core.counters.eviction_rounds += 1
        return victims

    def next_release_at(self) -> float | None:
        """When DRAM held only by a lease is next released (a retired extent, or a leased object
        eviction could then take), or None if nothing is waiting on a lease."""
        now = self.core.clock()
        times = [t for t, _, _ in self.core.retired]
        for entry in self.core.objects.values():
            if entry.readable and entry.lease_until > now and entry.dram_replicas():
                if (
                    entry.pending is None
                    and entry.busy is None
                    and not (entry.soft_pin and entry.pin_until > now)
                ):
                    times.append(entry.lease_until)
        return min(times, default=None)
