"""The client's lease cache: replica descriptors reused while their read lease lasts.

The replicas a get learns come with a read lease, and while it lasts the master frees or reuses
none of those bytes (a remove, upsert or eviction only *retires* them until the lease ends). With
the cache on (``StoreClientConfig.lease_cache``, off by default), the client keeps the descriptors
until ``margin_s`` before the lease ends and serves repeated gets of the same key without asking
the master: such a get returns the object as it was when the lease was granted, so a remove or
upsert by *another* client is seen only once the cached entry expires (within one lease TTL). The
client's own puts and removes drop its entries at once. Content-addressed keys (KV blocks) never
change, which makes the cache safe for them.
"""

from __future__ import annotations

from collections.abc import Iterable

from yutu.store.types import ReplicaDescriptor

Located = tuple[int, list[ReplicaDescriptor]]  # (size, replicas best first)


class LeaseCache:
    def __init__(self, margin_s: float) -> None:
        self.margin_s = margin_s
        self._entries: dict[str, tuple[float, Located]] = {}  # key -> (usable until, located)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float) -> Located | None:
        """The cached replicas of ``key`` if its entry is still usable at ``now`` (monotonic)."""
        entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0] > now else None

    def remember(self, key: str, located: Located, asked_at: float, lease_ttl_s: float) -> None:
        """Keep ``located``, learned from a request sent at ``asked_at`` under a ``lease_ttl_s``
        lease, until ``margin_s`` before that lease ends."""
        until = asked_at + lease_ttl_s - self.margin_s  # asked_at: before the lease began
        if until > asked_at:
            self._entries[key] = (until, located)

    def forget(self, keys: Iterable[str]) -> None:
        """Drop the entries of ``keys`` (this client changed or removed them, or a read failed)."""
        if self._entries:
            for key in keys:
                self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def prune(self, now: float, keep: int) -> None:
        """Drop expired entries once the cache holds more than ``keep``."""
        if len(self._entries) > keep:
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
