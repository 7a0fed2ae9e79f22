"""Noticing a Redis that lost the master's metadata, and writing all of it again.

Redis can come back without what the master wrote: restarted without persistence (or from an
older file), flushed, replaced. The master cannot tell from its incremental writes, which only
ever touch what changed. So it keeps one sentinel key next to its records::

    {prefix}:store:sentinel   string   who wrote it (instance id, pid, time); never deleted by the master

written at start-up and checked every ``interval_s``. When it is missing, Redis no longer holds
what the master wrote: the watch writes the sentinel, then every segment and object the master
holds, through the :class:`~services.store_master.persistence.Persister` (so the rewrite is ordered
with the incremental commits and never overwrites a newer value with an older one).

The sentinel goes first: if Redis loses data again after it, the write of the records fails and
its marks stay in the persister, or Redis loses the sentinel too; either way the next check sees
it (the watch also commits marks a failed write left behind, once Redis answers again).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from yutu.errors import YutuError

from services.store_master.persistence import Persister

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


class MetadataWatch:
    """``records()`` returns the names of every object and segment the master holds, now."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        persister: Persister,
        records: Callable[[], tuple[set[str], set[str]]],
        writer: str,
        interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.redis = redis
        self.key = f"{prefix}:store:sentinel"
        self.persister = persister
        self._records = records
        self._value = f"{writer} pid {os.getpid()} at {time.time():.0f}"
        self.interval_s = interval_s
        self.rewrites = 0  # full rewrites so far (for /stats)
        self._failing = False  # the last check could not reach Redis (logged once per outage)

    async def arm(self) -> None:
        """Write the sentinel (at start-up, after the metadata was loaded)."""
        await self.redis.set(self.key, self._value)

    async def check(self) -> bool:
        """One check; True if Redis had lost the metadata and it was written again. Raises
        ``RedisError``/``OSError``/``YutuError`` (UNAVAILABLE) when Redis cannot be reached."""
        if await self.redis.exists(self.key):
            if self.persister.dirty:  # a write failed while Redis was away: it is back
                await self.persister.commit()
            return False
        objects, segments = self._records()
        log.warning(
            "Redis lost the store metadata (%s is missing: restarted without its data, or flushed); "
            "writing %d segments and %d objects again",
            self.key,
            len(segments),
            len(objects),
        )
        await self.redis.set(self.key, self._value)
        self.persister.mark(objects, segments)
        await self.persister.commit()
        self.rewrites += 1
        log.info("store metadata written again: %d segments, %d objects", len(segments), len(objects))
        return True

    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled; an unreachable Redis is logged and retried."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except (RedisError, OSError, YutuError) as exc:
                if not self._failing:
                    log.warning("cannot check the store metadata in Redis (retrying every %gs): %s",
                                self.interval_s, exc)  # fmt: skip
                self._failing = True
                continue
            if self._failing:
                log.info("Redis answers again: store metadata checked")
            self._failing = False
