"""Puts in progress: ``put_start`` places the replicas a writer fills, ``put_end`` makes them
readable (replacing an upserted object's replicas) and ``put_revoke`` abandons them.

A put is known by its ``put_id``: a random prefix per master process and a serial, unique across
restarts. Reclaiming puts whose writer is gone is the sweep's job.
"""

from __future__ import annotations

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.kv_events import BlockStored, key_to_hash
from yutu.store.types import ReplicaState, validate_key

from services.store_master.objects import ObjectEntry, PendingPut, Replica
from services.store_master.state_core import NoSpaceError, StateCore, bad_request, check_int


class Puts:
    """The put protocol over the master's tables (``core``); only the master state calls it."""

    def __init__(self, core: StateCore) -> None:
        self.core = core

    def put_start(
        self,
        key: str,
        size: int,
        replicas: int = 1,
        soft_pin: bool = False,
        upsert: bool = False,
        writer: str = "",
    ) -> tuple[str | None, list[Replica]]:
        """Allocate replicas for ``key``: ``(put_id, replicas)`` to write, then ``put_end``.

        ``(None, [])`` when the key is already stored or being stored and ``upsert`` is false.
        Raises :class:`NoSpaceError` when no segment has room (the caller evicts and retries).
        """
        try:
            validate_key(key)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        check_int("size", size, 1)
        check_int("replicas", replicas, 1)
        entry = self.core.objects.get(key)
        if entry is not None:
            if entry.pending is not None:
                if not upsert:
                    return None, []
                raise YutuError(
                    f"key {key!r} is being written by {entry.pending.writer or 'another writer'}; retry the upsert "
                    "after that put ends",
                    ErrorKind.OVERLOADED,
                )
            if entry.readable and not upsert:
                return None, []
        if size > self.core.segments.largest_segment:
            if not len(self.core.segments):
                raise YutuError("no store segment is mounted: start a store node", ErrorKind.UNAVAILABLE)
            raise YutuError(
                f"object of {size} bytes is larger than the largest segment ({self.core.segments.largest_segment} "
                "bytes): split it or mount bigger segments",
                ErrorKind.TOO_LARGE,
            )
        placed = self.core.segments.place(size, replicas)
        if not placed:
            raise NoSpaceError(f"no segment has {size} free bytes for {key!r}: evict or add capacity")
        now = self.core.clock()
        put_id = f"{self.core.put_prefix}{next(self.core.put_serial):x}"
        pending = PendingPut(
            put_id,
            size,
            [Replica(name, offset, size, ReplicaState.WRITING) for name, offset in placed],
            now,
            writer if isinstance(writer, str) else "",
        )
        if entry is None:
            entry = ObjectEntry(key, 0, [], now)
            self.core.objects[key] = entry
        entry.pending = pending
        entry.soft_pin = bool(soft_pin) or (upsert and entry.soft_pin)
        self.core.effects.dirty_objects.add(key)
        return put_id, pending.replicas

    def put_end(self, key: str, put_id: str) -> bool:
        """Make the pending put readable; replaced replicas (upsert) are released. True when it
        released anything (space, a disk file or a disk-tier move): then its record must be in
        Redis before the space can serve another object (see services.store_master.settle)."""
        entry, pending = self._pending(key, put_id)
        now = self.core.clock()
        was_readable = entry.readable
        released = bool(entry.replicas) or entry.busy is not None
        if entry.busy is not None:  # an upsert overtook a disk-tier move: that move no longer applies
            self.core.disk.forget(entry)
            entry.busy = None
        for replica in entry.replicas:
            self.core.release(entry, replica)
        for replica in pending.replicas:
            replica.state = ReplicaState.COMPLETE
        entry.replicas = pending.replicas
        entry.size = pending.size
        entry.pending = None
        if entry.soft_pin:
            entry.pin_until = now + self.core.policy.soft_pin_ttl_s
        self.core.eviction.stored(entry)
        self.core.effects.dirty_objects.add(key)
        if not was_readable:
            self.core.effects.events.append(
                BlockStored([key_to_hash(key)], block_size=self.core.policy.block_size)
            )
        return released

    def put_revoke(self, key: str, put_id: str) -> None:
        """Abandon a pending put; its space is freed at once (the writer says it stopped)."""
        entry, pending = self._pending(key, put_id)
        for replica in pending.replicas:
            assert replica.offset is not None
            self.core.segments.free(replica.segment, replica.offset)
        entry.pending = None
        if not entry.readable:
            del self.core.objects[key]
        self.core.effects.dirty_objects.add(key)

    def _pending(self, key: str, put_id: str) -> tuple[ObjectEntry, PendingPut]:
        entry = self.core.objects.get(key) if isinstance(key, str) else None
        if entry is None or entry.pending is None or entry.pending.put_id != put_id:
            raise YutuError(
                f"no put {put_id!r} is in progress for {key!r} (revoked, timed out, removed or its node was "
                "lost): put the object again",
                ErrorKind.NOT_FOUND,
            )
        return entry, entry.pending
