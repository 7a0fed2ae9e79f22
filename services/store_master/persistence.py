"""Durable store metadata in Redis, written with group commit.

Layout (values are msgpack lists, see :mod:`services.store_master.objects`)::

    {prefix}:store:objects    hash  object key  -> ObjectEntry.to_wire()
    {prefix}:store:segments   hash  segment name -> Segment.to_wire()

Allocations are not stored: they are rebuilt from the replicas on recovery. Leases, retired space
and disk-tier tasks in flight are not stored either; a restarted master starts without them.

:class:`Persister` batches writes: operations mark what they changed, then ``await commit()``.
A mark takes the record's bytes then (its in-memory value packed, or a delete when it is gone; a
later mark of it replaces them), and one write sends everything marked so far, so concurrent
operations share round trips and a commit's own work is only the write. An operation that awaits
``commit`` is acknowledged only after its metadata is in Redis; one that only asks for
``commit_soon`` (a put_end written behind, a put_start) is written within that delay -- which
operations may do that is :mod:`services.store_master.settle`'s rule.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import hiredis
import msgpack
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from yutu.errors import ErrorKind, YutuError

from services.store_master.objects import ObjectEntry, Segment

if TYPE_CHECKING:
    from services.store_master.state import MasterState

log = logging.getLogger(__name__)

RETRY_S = 1.0  # a failed background commit is tried again this much later (or by the next commit)
# A write whose connection is lost goes again on a fresh one (as yutu.redis_conn's clients resend
# a command): this many times more, after these pauses.
WRITE_RETRIES_S = (0.05, 0.2)


class MetadataStore:
    """The master's records in Redis. :meth:`write` sends its commands on a connection of its own,
    held between writes, packed by hiredis into one buffer and sent in one write, then reads the
    replies: the commit's whole cost on the event loop, a few microseconds beside a Redis round
    trip. Through the client's ``execute_command`` (its connection pool, its retry wrapper,
    redis-py's pipeline for two commands) a write of ~70 records took ~130 us of the loop's CPU
    against ~85 here, time in which a put waiting for the master is not answered."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.objects_key = f"{prefix}:store:objects"
        self.segments_key = f"{prefix}:store:segments"
        self._connection: AbstractConnection | None = None
        self._lock = asyncio.Lock()  # one write at a time on the held connection

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
        """Set each record to its bytes, or delete it where they are None."""
        commands = write_commands(self.objects_key, objects, self.segments_key, segments)
        if not commands:
            return
        packed = b"".join(hiredis.pack_command(command) for command in commands)
        async with self._lock:
            for pause in (*WRITE_RETRIES_S, None):
                try:
                    await self._send(packed, len(commands))
                    return
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    if pause is None:
                        raise
                await asyncio.sleep(pause)

    async def _send(self, packed: bytes, replies: int) -> None:
        connection = self._connection
        if connection is None:
            connection = self._connection = await self.redis.connection_pool.get_connection()
        try:
            await connection.send_packed_command(packed, check_health=False)
            for _ in range(replies):
                await connection.read_response()
        except BaseException:  # replies unread (or an error reply among them): start afresh
            self._connection = None
            await connection.disconnect()
            await self.redis.connection_pool.release(connection)
            raise

    async def clear(self) -> None:
        await self.redis.delete(self.objects_key, self.segments_key)


# One packer for every record (packb makes one per call, half of a small record's cost); only the
# event loop's thread writes records.
_pack = msgpack.Packer(use_bin_type=True).pack


def write_commands(
    objects_key: str, objects: dict[str, bytes | None], segments_key: str, segments: dict[str, bytes | None]
) -> list[tuple[Any, ...]]:
    """The Redis commands that write ``objects`` and ``segments``: an HSET of each hash's records,
    an HDEL of its deleted ones (each left out when empty)."""
    commands: list[tuple[Any, ...]] = []
    for hash_key, records in ((objects_key, objects), (segments_key, segments)):
        puts = [x for k, v in records.items() if v is not None for x in (k, v)]
        gone = [k for k, v in records.items() if v is None]
        if puts:
            commands.append(("HSET", hash_key, *puts))
        if gone:
            commands.append(("HDEL", hash_key, *gone))
    return commands


def object_record(state: MasterState, key: str) -> bytes | None:
    """The Redis record of object ``key`` now (None: it is gone)."""
    entry = state.objects.get(key)
    return None if entry is None else _pack(entry.to_wire())


def segment_record(state: MasterState, name: str) -> bytes | None:
    """The Redis record of segment ``name`` now (None: it is gone)."""
    segment = state.segments.get(name)
    return None if segment is None else _pack(segment.to_wire())


def _text(raw: bytes | str) -> str:
    return raw.decode("utf-8", "surrogatepass") if isinstance(raw, bytes) else raw


class Persister:
    """Group-commit writer; ``snapshot_object``/``snapshot_segment`` give a record's current bytes,
    taken when it is marked.

    The first caller of :meth:`commit` with nothing in flight writes at once (inline, no hop to
    another task); callers arriving meanwhile wait for it and, if their marks came after it took
    the marks, one of them writes the next batch. A failed write keeps the marks for the next.
    :meth:`commit_soon` schedules a commit that nobody waits for (a failure is logged and the marks
    stay for the next commit, tried again after ``RETRY_S`` at the latest).
    """

    def __init__(
        self,
        store: MetadataStore,
        snapshot_object: Callable[[str], bytes | None],
        snapshot_segment: Callable[[str], bytes | None],
    ) -> None:
        self.store = store
        self._snapshot_object = snapshot_object
        self._snapshot_segment = snapshot_segment
        self._objects: dict[str, bytes | None] = {}  # marked records' bytes (None: delete it)
        self._segments: dict[str, bytes | None] = {}
        self._marked = 0  # generation of the latest mark
        self._written = 0  # every mark up to this generation is in Redis
        self._inflight: asyncio.Future[None] | None = None
        self._background: asyncio.Task[bool] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._closing = False  # close() writes what is left itself
        self.writes = 0  # pipelines written (for /stats)

    def mark(self, objects: set[str], segments: set[str]) -> None:
        """Take these records' bytes now, for the next commit (spread over the operations that
        change them, not gathered into the commit: a put's master waits through a commit's work)."""
        if objects or segments:
            for key in objects:
                self._objects[key] = self._snapshot_object(key)
            for name in segments:
                self._segments[name] = self._snapshot_segment(name)
            self._marked += 1

    @property
    def dirty(self) -> bool:
        return bool(self._objects or self._segments)

    async def commit(self) -> None:
        """Return once everything marked before this call is in Redis; raises UNAVAILABLE if not."""
        wanted = self._marked
        while self._written < wanted:
            if self._inflight is not None:
                await asyncio.shield(self._inflight)
                continue
            await self._write()

    def commit_soon(self, delay_s: float = 0.0) -> None:
        """Write what is marked within ``delay_s`` without waiting for it; a commit made meanwhile
        (which writes every marked record's current value) makes the background one a no-op, so
        records that change again soon are written once. At most one background commit runs; a
        shorter ``delay_s`` than the pending timer's brings it forward.

        Marks made while a background write is in flight wait for their own delay, not for the
        end of that write: a stream of puts written behind costs one Redis write per delay, not
        one per put (chaining the next write to the end of the last one made a write of a record
        or two every few hundred microseconds, each with its ~150 us of the loop's CPU)."""
        if self._closing or self._written >= self._marked:
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + delay_s
        if self._timer is not None:
            if self._timer.when() <= due:
                return
            self._timer.cancel()
        self._timer = loop.call_at(due, self._start_background)

    def _start_background(self) -> None:
        self._timer = None
        if self._written >= self._marked:
            return
        running = self._background
        if running is not None and not running.done():  # due while a write is in flight: right after it
            running.add_done_callback(self._after_background)
            return
        self._background = asyncio.ensure_future(self._commit_logged())

    def _after_background(self, task: asyncio.Task[bool]) -> None:
        if not task.cancelled() and task.result():  # a failed one is retried by its own timer
            self.commit_soon()

    async def _commit_logged(self) -> bool:
        """Write what is marked now (marks made meanwhile have their own timer); False if it failed."""
        try:
            await self.commit()
        except YutuError as exc:
            log.warning("background metadata commit failed (kept, retried in %.0f s): %s", RETRY_S, exc)
            self._retry = asyncio.get_running_loop().call_later(RETRY_S, self.commit_soon)
            return False
        return True

    async def _write(self) -> None:
        self._inflight = asyncio.get_running_loop().create_future()
        generation = self._marked
        objects, self._objects = self._objects, {}
        segments, self._segments = self._segments, {}
        try:
            await self.store.write(objects, segments)
        except (RedisError, OSError) as exc:
            log.warning("writing store metadata to Redis failed: %s", exc)
            self._objects = {**objects, **self._objects}  # kept for the next commit (marks since: newer)
            self._segments = {**segments, **self._segments}
            error = YutuError(
                f"store metadata could not be saved to Redis ({exc}); retry", ErrorKind.UNAVAILABLE
            )
            self._inflight.set_exception(error)
            self._inflight.exception()  # retrieved: waiters get it from their own await
            self._inflight = None
            raise error from None
        self.writes += 1
        self._written = max(self._written, generation)
        self._inflight.set_result(None)
        self._inflight = None

    async def close(self) -> None:
        """Write what is still marked."""
        self._closing = True
        for timer in (self._timer, self._retry):
            if timer is not None:
                timer.cancel()
        self._timer = self._retry = None
        if self._background is not None:
            await asyncio.gather(self._background, return_exceptions=True)
        if self.dirty:
            try:
                await asyncio.wait_for(self.commit(), 5.0)
            except (TimeoutError, YutuError) as exc:
                log.warning("final metadata write failed: %s", exc)
