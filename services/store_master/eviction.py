"""Which objects to evict: least recently accessed first, never a protected one.

Pure policy over the master's records, so tests can pin exact victim lists. An object is protected
while it is leased (a reader may be copying it), being written (a put or upsert in progress),
soft-pinned (until the pin's TTL runs out) or busy with a disk-tier task.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from yutu.store.allocator import align_up

from services.store_master.objects import ObjectEntry


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
