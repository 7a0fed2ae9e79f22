"""Puts in progress: ``put_start`` places the replicas a writer fills, ``put_end`` makes them
readable (replacing an upserted object's replicas) and ``put_revoke`` abandons them.

Reservations are puts whose key comes last: ``reserve`` places one replica for a writer ahead of
its puts, ``commit`` names the key and ends the put, ``unreserve`` gives the space back. A writer
holding reservations puts with one transfer and one RPC (the commit, which also reserves again)
instead of two RPCs around the transfer. They live in ``core.reserved``, not among the objects,
and are not persisted: a restarted master counts their space free, so a writer drops its
reservations when its connection to the master drops (:mod:`yutu.store.reservations`).

A put is known by its ``put_id``: a random prefix per master process and a serial, unique across
restarts. Reclaiming puts (and reservations) not ended within the put timeout is the sweep's job.
"""

from __future__ import annotations

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.kv_events import key_to_hash
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
    ) -> tuple[str | None, tuple[Replica, ...]]:
        """Allocate replicas for ``key``: ``(put_id, replicas)`` to write, then ``put_end``.

        ``(None, ())`` when the key is already stored or being stored and ``upsert`` is false.
        Raises :class:`NoSpaceError` when no segment has room (the caller evicts and retries).
        """
        try:
            validate_key(key)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        check_int("size", size, 1)
        check_int("replicas", replicas, 1)
        entry = self.core.objects.get(key)
        if self._taken(entry, upsert):
            return None, ()
        pending = self._place(size, replicas, writer, repr(key))
        if entry is None:
            entry = ObjectEntry(key, 0, (), pending.started_at)
            self.core.objects[key] = entry
        entry.pending = pending
        entry.soft_pin = bool(soft_pin) or (upsert and entry.soft_pin)
        self.core.effects.dirty_objects.add(key)
        return pending.put_id, pending.replicas

    @staticmethod
    def _taken(entry: ObjectEntry | None, upsert: bool) -> bool:
        """Whether a put of ``entry``'s key must not go ahead: it is stored, or being stored, and
        not ``upsert``. Raises OVERLOADED for an upsert while another put of the key runs."""
        if entry is None:
            return False
        if entry.pending is not None:
            if not upsert:
                return True
            raise YutuError(
                f"key {entry.key!r} is being written by {entry.pending.writer or 'another writer'}; retry the "
                "upsert after that put ends",
                ErrorKind.OVERLOADED,
            )
        return entry.readable and not upsert

    def _place(self, size: int, replicas: int, writer: str, what: str) -> PendingPut:
        """A new put of ``size`` bytes with ``replicas`` WRITING replicas placed; raises TOO_LARGE,
        UNAVAILABLE (no segment) or :class:`NoSpaceError` (the caller evicts and retries)."""
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
            raise NoSpaceError(f"no segment has {size} free bytes for {what}: evict or add capacity")
        return PendingPut(
            f"{self.core.put_prefix}{next(self.core.put_serial):x}",
            size,
            tuple([Replica(name, offset, size, ReplicaState.WRITING) for name, offset in placed]),
            self.core.clock(),
            writer if isinstance(writer, str) else "",
        )

    def reserve(self, size: int, writer: str = "") -> PendingPut:
        """Place one replica of ``size`` bytes for a put ``writer`` keys at :meth:`commit`.
        Raises as :meth:`put_start` when there is no room."""
        check_int("size", size, 1)
        pending = self._place(size, 1, writer, "a reservation")
        self.core.reserved[pending.put_id] = pending
        return pending

    def commit(self, key: str, put_id: str, soft_pin: bool = False, upsert: bool = False) -> bool | None:
        """End reservation ``put_id``'s put as ``key``'s (as put_start + put_end would). None when
        ``key`` is stored or being stored and not ``upsert``: nothing changes, the reservation stays
        its writer's. Else put_end's answer: True when it released space (an upsert)."""
        try:
            validate_key(key)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        pending = self.core.reserved.get(put_id) if isinstance(put_id, str) else None
        if pending is None:
            raise self._no_reservation(put_id)
        entry = self.core.objects.get(key)
        if self._taken(entry, upsert):
            return None
        del self.core.reserved[put_id]
        if entry is None:
            entry = ObjectEntry(key, 0, (), self.core.clock())
            self.core.objects[key] = entry
        entry.pending = pending
        entry.soft_pin = bool(soft_pin) or (upsert and entry.soft_pin)
        return self.put_end(key, put_id)

    def unreserve(self, put_id: str) -> None:
        """Free a reservation at once (its writer gave it back)."""
        pending = self.core.reserved.pop(put_id, None) if isinstance(put_id, str) else None
        if pending is None:
            raise self._no_reservation(put_id)
        for replica in pending.replicas:
            assert replica.offset is not None
            self.core.segments.free(replica.segment, replica.offset)

    @staticmethod
    def _no_reservation(put_id: object) -> YutuError:
        return YutuError(
            f"no reservation {put_id!r} (reclaimed after the put timeout, its node was lost, or the master "
            "restarted): put the object again",
            ErrorKind.NOT_FOUND,
        )

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
            self.core.effects.stored(key_to_hash(key), self.core.policy.block_size)
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
