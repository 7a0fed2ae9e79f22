"""Cache hit ratio of a trace through one cache of a given capacity: the capacity experiment.

Every request's blocks, in arrival order, against a single :class:`~yutu.sim.cache.BlockCache`
(the whole pool, no scheduling): its hits are the leading blocks the cache holds (a prefix is only
reusable from its start), then all its blocks are admitted. All ``hash_ids`` count, the partial tail
block included, as the traces' README and the paper count blocks. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable

from yutu.sim.cache import BlockCache
from yutu.sim.trace import TraceRequest, block_key


def hit_ratio(requests: Iterable[TraceRequest], policy: str, capacity: int | None) -> float:
    """Blocks hit / blocks requested, for ``capacity`` blocks (None: unlimited) under ``policy``."""
    cache = BlockCache(policy, capacity)
    hits = total = 0
    for r in requests:
        keys = [block_key(h) for h in r.hash_ids]
        hits += cache.prefix_hits(keys)
        total += len(keys)
        cache.admit(keys)
    return hits / total if total else 0.0
