"""The segment directory: segment descriptors published in Redis with a TTL, looked up by name.

Keys: ``{prefix}:segment:{name}`` -> descriptor JSON, expiring after ``ttl_s`` unless the owner keeps
it alive (the engine re-publishes every ``ttl_s / 3``). Lookups are cached for ``cache_ttl_s``;
callers ``invalidate(name)`` when a transfer to that segment fails so the next lookup goes to Redis.
"""

from __future__ import annotations

import time
from typing import Any

from yutu.transfer.errors import SegmentConflictError, SegmentNotFoundError
from yutu.transfer.region import pid_alive
from yutu.transfer.segment import SegmentDescriptor, local_host_id, local_pid_namespace

# Delete the key only if it still holds the given incarnation (never a successor's descriptor).
_WITHDRAW_LUA = """
local v = redis.call('GET', KEYS[1])
if v and string.find(v, ARGV[1], 1, true) then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class SegmentDirectory:
    """Publish and look up segment descriptors in Redis (``redis.asyncio`` client)."""

    def __init__(
        self, redis: Any, prefix: str = "yutu", ttl_s: float = 10.0, cache_ttl_s: float = 2.0
    ) -> None:
        if ttl_s <= 0 or cache_ttl_s < 0:
            raise ValueError(f"ttl_s must be > 0 and cache_ttl_s >= 0, got {ttl_s}, {cache_ttl_s}")
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, SegmentDescriptor]] = {}  # name -> (fetched_at, desc)

    def key(self, name: str) -> str:
        return f"{self.prefix}:segment:{name}"

    async def claim(self, desc: SegmentDescriptor) -> None:
        """Publish ``desc`` for the first time.

        Raises ``SegmentConflictError`` if a live engine already holds the name. A holder on this
        host whose process is gone (killed before its TTL ran out) is treated as stale and replaced.
        """
        existing = await self._fetch(desc.name)
        if existing is None:
            # SET NX: of two engines starting under one name at once, exactly one wins.
            if await self.redis.set(self.key(desc.name), desc.to_json(), px=int(self.ttl_s * 1000), nx=True):
                self._cache[desc.name] = (time.monotonic(), desc)
                return
            existing = await self._fetch(desc.name)
        if existing is not None and existing.incarnation != desc.incarnation:
            local = existing.same_pid_namespace(local_host_id(), local_pid_namespace())
            if not (local and not pid_alive(existing.pid)):
                raise SegmentConflictError(
                    f"segment name {desc.name!r} is already published by pid {existing.pid} on "
                    f"{existing.hostname}; pick another name or stop that process "
                    f"(its entry expires {self.ttl_s:g}s after it stops)"
                )
        await self.publish(desc)

    async def publish(self, desc: SegmentDescriptor) -> None:
        """Write (or refresh) ``desc`` with a TTL of ``ttl_s``. Last writer wins."""
        await self.redis.set(self.key(desc.name), desc.to_json(), px=int(self.ttl_s * 1000))
        self._cache[desc.name] = (time.monotonic(), desc)

    async def withdraw(self, desc: SegmentDescriptor) -> None:
        """Delete the entry for ``desc.name`` if it is still this incarnation's."""
        self._cache.pop(desc.name, None)
        marker = f'"incarnation":{desc.incarnation},'
        await self.redis.eval(_WITHDRAW_LUA, 1, self.key(desc.name), marker)

    async def lookup(self, name: str, *, fresh: bool = False) -> SegmentDescriptor:
        """The descriptor of segment ``name``, from cache unless ``fresh`` or older than ``cache_ttl_s``.

        Raises ``SegmentNotFoundError`` if no live engine publishes it.
        """
        if not fresh:
            cached = self._cache.get(name)
            if cached is not None and time.monotonic() - cached[0] <= self.cache_ttl_s:
                return cached[1]
        desc = await self._fetch(name)
        if desc is None:
            self._cache.pop(name, None)
            raise SegmentNotFoundError(f"segment not found: {name!r} is not published in the directory")
        self._cache[name] = (time.monotonic(), desc)
        return desc

    def invalidate(self, name: str) -> None:
        """Forget the cached descriptor of ``name``; the next lookup reads Redis."""
        self._cache.pop(name, None)

    async def names(self) -> list[str]:
        """Names of all published segments (SCAN; for admin pages and tests)."""
        start = len(self.key(""))
        out: list[str] = []
        async for key in self.redis.scan_iter(match=self.key("*")):
            text = key.decode() if isinstance(key, bytes) else key
            out.append(text[start:])
        return sorted(out)

    async def _fetch(self, name: str) -> SegmentDescriptor | None:
        raw = await self.redis.get(self.key(name))
        if raw is None:
            return None
        return SegmentDescriptor.from_json(raw)
