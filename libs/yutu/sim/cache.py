"""A bounded set of KV block keys ordered by a ``yutu.evict`` policy: an instance's prefix cache or the
shared store.

Every block is one unit of capacity. ``admit`` makes a chain of keys resident, evicting what the
policy names (never a key of the chain being admitted); ``touch`` records hits. ``capacity=None`` is
an unlimited cache (a set; no policy needed), ``capacity=0`` one that holds nothing (no store). The cache answers ``key in cache``, so it can be handed
to a :class:`yutu.sched.ClusterView` as a key set as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from yutu.evict import EvictionPolicy, make_policy


class BlockCache:
    def __init__(self, policy: str, capacity: int | None) -> None:
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0
        ):
            raise ValueError(
                f"a cache capacity must be an integer >= 0 blocks (0: none) or None (unlimited), got {capacity!r}"
            )
        self.capacity = capacity
        self._policy: EvictionPolicy | None = (
            None if capacity is None else make_policy(policy, max(1, capacity))
        )
        self._keys: set[str] = set()
        self.evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> frozenset[str]:
        """The resident keys (a copy)."""
        return frozenset(self._keys)

    def prefix_hits(self, keys: Sequence[str], limit: int | None = None) -> int:
        """Leading keys of ``keys`` resident here (at most ``limit``), stopping at the first miss."""
        end = len(keys) if limit is None else min(limit, len(keys))
        for i in range(end):
            if keys[i] not in self._keys:
                return i
        return end

    def touch(self, keys: Iterable[str]) -> None:
        """Record a hit on each resident key of ``keys`` (others are ignored)."""
        if self._policy is None:
            return
        for key in keys:
            if key in self._keys:
                self._policy.access(key)

    def admit(self, keys: Sequence[str]) -> int:
        """Make ``keys`` resident (resident ones count as hits); returns how many are new.

        Evicts the policy's victims to make room, never a key of ``keys``; when the rest of the cache
        cannot make enough room, the chain's tail stays out (a prefix is only useful from its start).
        """
        if self.capacity == 0:
            return 0
        new = [k for k in dict.fromkeys(keys) if k not in self._keys]
        self.touch(k for k in keys if k in self._keys)
        if self._policy is None:
            self._keys.update(new)
            return len(new)
        assert self.capacity is not None
        need = len(self._keys) + len(new) - self.capacity
        if need > 0:
            chain = set(keys)
            victims = self._policy.victims(need, lambda k: k in chain)
            for key in victims:
                self._policy.remove(key)
                self._keys.discard(key)
            self.evictions += len(victims)
            new = new[: max(0, self.capacity - len(self._keys))]
        for key in new:
            self._policy.insert(key, 1)
            self._keys.add(key)
        return len(new)
