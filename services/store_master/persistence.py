"""Durable store metadata in Redis, written with group commit.

Layout (values are msgpack lists, see :mod:`services.store_master.objects`)::

    {prefix}:store:objects    hash  object key  -> ObjectEntry.to_wire()
    {prefix}:store:segments   hash  segment name -> Segment.to_wire()

Allocations are not stored: they are rebuilt from the replicas on recovery. Leases, retired space
and disk-tier tasks in flight are not stored either; a restarted master starts without them.

:class:`Persister` batches writes: operations mark what they changed, then ``await commit()``.
One flusher task writes everything marked so far in one pipeline (the current in-memory value of
each marked record, or a delete when it is gone), so concurrent operations share round trips and
an operation is acknowledged only after its metadata is in Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from yutu.errors import ErrorKind, YutuError

from services.store_master.objects import ObjectEntry, Segment

log = logging.getLogger(__name__)


class MetadataStore:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.objects_key = f"{prefix}:store:objects"
        self.segments_key = f"{prefix}:store:segments"

    async def load(self) -> tuple[list[Segment], list[ObjectEntry]]:
        segments = [
            Segment.from_wire(_text(name), msgpack.unpackb(raw, raw=False))
            async for name, raw in self.redis.hscan_iter(self.segments_key, count=1000)
        ]
        objects = [
            ObjectEntry.from_wire(_text(key), msgpack.unpackb(raw, raw=False))
            async for key, raw in self.redis.hscan_iter(self.objects_key, count=1000)
        ]
        return segments, objects

    async def write(self, objects: dict[str, bytes | None], segments: dict[str, bytes | None]) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for hash_key, records in ((self.objects_key, objects), (self.segments_key, segments)):
                puts = {k: v for k, v in records.items() if v is not None}
                gone = [k for k, v in records.items() if v is None]
                if puts:
                    pipe.hset(hash_key, mapping=puts)  # type: ignore[arg-type]
                if gone:
                    pipe.hdel(hash_key, *gone)
            await pipe.execute()

    async def clear(self) -> None:
        await self.redis.delete(self.objects_key, self.segments_key)


def _text(raw: bytes | str) -> str:
    return raw.decode("utf-8", "surrogatepass") if isinstance(raw, bytes) else raw


class Persister:
    """Group-commit writer; ``snapshot_object``/``snapshot_segment`` give a record's current bytes."""

    def __init__(
        self,
        store: MetadataStore,
        snapshot_object: Callable[[str], bytes | None],
        snapshot_segment: Callable[[str], bytes | None],
    ) -> None:
        self.store = store
        self._snapshot_object = snapshot_object
        self._snapshot_segment = snapshot_segment
        self._objects: set[str] = set()
        self._segments: set[str] = set()
        self._wakeup = asyncio.Event()
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.writes = 0  # pipelines written (for /stats)

    def mark(self, objects: set[str], segments: set[str]) -> None:
        self._objects |= objects
        self._segments |= segments

    @property
    def dirty(self) -> bool:
        return bool(self._objects or self._segments)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="store-persister")

    async def commit(self) -> None:
        """Return once everything marked before this call is in Redis; raises UNAVAILABLE if not."""
        if self._task is None:
            raise YutuError("the metadata writer is not running", ErrorKind.UNAVAILABLE)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        future = self._next
        self._wakeup.set()
        await asyncio.shield(future)

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            future, self._next = self._next, None
            objects, self._objects = self._objects, set()
            segments, self._segments = self._segments, set()
            try:
                await self.store.write(
                    {k: self._snapshot_object(k) for k in objects},
                    {n: self._snapshot_segment(n) for n in segments},
                )
                self.writes += 1
                if future is not None and not future.done():
                    future.set_result(None)
            except (RedisError, OSError) as exc:
                log.warning("writing store metadata to Redis failed: %s", exc)
                self._objects |= objects  # retried with the next commit
                self._segments |= segments
                if future is not None and not future.done():
                    future.set_exception(
                        YutuError(
                            f"store metadata could not be saved to Redis ({exc}); retry",
                            ErrorKind.UNAVAILABLE,
                        )
                    )

    async def close(self) -> None:
        """Write what is still marked, then stop."""
        if self._task is None:
            return
        if self.dirty:
            try:
                await asyncio.wait_for(self.commit(), 5.0)
            except (TimeoutError, YutuError) as exc:
                log.warning("final metadata write failed: %s", exc)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
