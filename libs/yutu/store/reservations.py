"""Reservations: space the master set aside for this client's next puts, by object size.

A classic put is two RPCs around the transfer (``BatchPutStart``, write, ``BatchPutEnd``). A put
that takes a reservation (``BatchReserve``, made ahead) is one transfer and one RPC: the writer
writes into the reserved replica, then ``BatchPutCommit`` names the keys, makes them readable and
reserves the same sizes again for the next put. On a small host a round trip to the master is
most of a small put's time (two process wake-ups each way), so this is what makes 64 KiB puts
fast (``loadtests/bench_store.py``).

What a reservation may cost, and why it is safe:

- Space: a client holds at most ``StoreClientConfig.reserve_bytes`` (a call whose objects total
  more puts the classic way); the space counts as used on the master, and an unused reservation
  is reclaimed after the master's put timeout. The client uses one only in the first half of that
  time and gives the rest back on ``close``.
- Master restarts: the master does not persist reservations (a restarted one counts their space
  free), so each is tagged with the master client's session
  (:attr:`~yutu.store.master.MasterClient.session`, which changes when the connection to the
  master drops) and never written once the session changed. A write in flight while the master
  dies is the same exposure as a classic put whose put_start was not yet persisted.
- Keys already stored: the commit answers 0 and the reservation stays the client's (the bytes
  written there are overwritten by a later put).
- A reservation that cannot be written (its node died) is given back, and one lost meanwhile
  (reclaimed, or dropped with its segment) makes the commit answer NOT_FOUND: either way the key
  is put again the classic way, so a put fails only where a classic put would.
"""

from __future__ import annotations

from dataclasses import dataclass

from yutu.store.types import ReplicaDescriptor


@dataclass(slots=True)
class Reservation:
    put_id: str
    replica: ReplicaDescriptor  # where to write (the one replica)
    size: int
    session: int  # the master client's session it was made in
    use_by: float  # monotonic; not written after this (half the master's put timeout)


class Reservations:
    """The client's pool (one per :class:`~yutu.store.datapath.DataPath`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[Reservation]] = {}
        self.held_bytes = 0  # in the pool (not those taken by a put in progress)
        self._expired: list[str] = []  # put_ids the master still knows, to give back

    def covers(self, sizes: list[int]) -> bool:
        """Whether a put of objects of these sizes goes through reservations."""
        return sum(sizes) <= self.max_bytes

    def take(self, size: int, session: int, now: float) -> Reservation | None:
        """A usable reservation of exactly ``size`` bytes, or None. Stale ones met on the way are
        dropped: from another session (that master is gone) or past use (given back later)."""
        free = self._free.get(size)
        while free:
            r = free.pop()
            self.held_bytes -= r.size
            if r.session != session:
                continue
            if now > r.use_by:
                self._expired.append(r.put_id)
                continue
            return r
        return None

    def add(self, r: Reservation) -> None:
        """Keep ``r`` for a later put (a new one, or one whose commit found its key stored); one
        that would take the pool past ``max_bytes`` is given back instead."""
        if self.held_bytes + r.size > self.max_bytes:
            self._expired.append(r.put_id)
            return
        self._free.setdefault(r.size, []).append(r)
        self.held_bytes += r.size

    def wanted(self, sizes: list[int]) -> list[int]:
        """Of the sizes just used, those to reserve again without passing ``max_bytes``."""
        room = self.max_bytes - self.held_bytes
        out = []
        for size in sizes:
            if size <= room:
                out.append(size)
                room -= size
        return out

    def to_release(self) -> list[str]:
        """Reservations the master still holds for this client that it will not use (taken)."""
        out, self._expired = self._expired, []
        return out

    def drain(self, session: int | None) -> list[str]:
        """Empty the pool: the put_ids the master of ``session`` still holds (to give back)."""
        out = self.to_release()
        for free in self._free.values():
            out += [r.put_id for r in free if r.session == session]
        self._free.clear()
        self.held_bytes = 0
        return out
