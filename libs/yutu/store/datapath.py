"""The store's data path: the put and get protocols between a client, the master and the nodes.

A put: ``BatchPutStart`` allocates each key's replicas and says where to write them, every replica
is written in one transfer batch, then ``BatchPutEnd`` completes the keys whose writes all
succeeded (the master acknowledges once their metadata is durable) and ``BatchPutRevoke`` frees
the rest. With reservations (:mod:`yutu.store.reservations`; single-replica puts of up to
``reserve_bytes`` in one call) a put is the transfer and one ``BatchPutCommit``, which also
reserves the space the next put will write; the classic protocol stays the reference and the
fallback. A get: ``BatchGetReplicas`` returns each key's replicas under a read lease (or the lease
cache does, see :mod:`yutu.store.leases`), best first (same host, then the master's order); each
key is read from its best replica and, when that transfer fails, from the next one.

:class:`~yutu.store.client.StoreClient` is the API on top: it checks arguments, stages plain
bytes through its staging buffer and turns per-key outcomes into return values and errors.
"""

from __future__ import annotations

import logging
import time

from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.store.leases import LeaseCache, Located
from yutu.store.master import MasterClient
from yutu.store.reservations import Reservation, Reservations
from yutu.store.types import PutOptions
from yutu.transfer import TransferEngine, TransferOp, TransferRequest

log = logging.getLogger(__name__)

_UNKNOWN = YutuError("internal: key not located", ErrorKind.INTERNAL)


class DataPath:
    def __init__(
        self,
        master: MasterClient,
        engine: TransferEngine,
        leases: LeaseCache,
        *,
        client_id: str,
        host_id: str,
        lease_cache: bool,
        reserve_bytes: int = 0,
    ) -> None:
        """``client_id`` names the writer to the master (a vanished writer's puts are reclaimed);
        ``host_id`` ranks same-host replicas first; ``lease_cache`` turns the cache on;
        ``reserve_bytes`` > 0 puts through reservations of up to that much (0: classic puts only)."""
        self.master = master
        self.engine = engine
        self.leases = leases
        self.client_id = client_id
        self.host_id = host_id
        self.lease_cache = lease_cache
        self.reservations = Reservations(reserve_bytes) if reserve_bytes > 0 else None

    async def put(
        self, keys: list[str], sources: list[tuple[str, int, int]], opts: PutOptions
    ) -> list[bool | YutuError]:
        """Put ``keys[i]`` from ``sources[i]`` = (registered local region, offset, length). Per
        key: True (stored), False (already stored) or the error. Through reservations when the
        client keeps them and the put fits (:meth:`put_reserved`), else :meth:`put_started`."""
        if not keys:
            return []
        self.leases.forget(keys)
        pool = self.reservations
        if (
            pool is not None
            and opts.replicas == 1
            and self.master.session is not None
            and pool.covers([s[2] for s in sources])
        ):
            return await self.put_reserved(keys, sources, opts, pool)
        return await self.put_started(keys, sources, opts)

    async def put_reserved(
        self, keys: list[str], sources: list[tuple[str, int, int]], opts: PutOptions, pool: Reservations
    ) -> list[bool | YutuError]:
        """A single-replica put into reservations: the keys without one reserve first (one RPC),
        every object is written in one transfer batch, then one commit makes the written keys
        readable and reserves their sizes again. Keys whose reservation could not be made, could
        not be written or was lost meanwhile are put with :meth:`put_started`."""
        session = self.master.session
        assert session is not None
        now = time.monotonic()
        sizes = [s[2] for s in sources]
        held: list[Reservation | None] = [pool.take(size, session, now) for size in sizes]
        missing = [i for i, r in enumerate(held) if r is None]
        if missing:
            reply = await self.master.call(p.BatchReserve([sizes[i] for i in missing], self.client_id))
            use_by = now + reply.ttl_s / 2
            for i, outcome in zip(missing, reply.results, strict=True):
                try:
                    slot = p.unwrap(outcome)
                except YutuError:
                    continue  # no room for it now: put the classic way, which waits for room
                assert slot.put_id is not None
                held[i] = Reservation(slot.put_id, slot.replicas[0], sizes[i], session, use_by)
        results: list[bool | YutuError] = [False] * len(keys)
        classic = [i for i, r in enumerate(held) if r is None]
        chosen = [i for i, r in enumerate(held) if r is not None]
        requests = []
        for i in chosen:
            r = held[i]
            assert r is not None and r.replica.offset is not None
            region, offset, length = sources[i]
            requests.append(
                TransferRequest(
                    TransferOp.WRITE,
                    region,
                    offset,
                    r.replica.segment,
                    r.replica.region,
                    r.replica.offset,
                    length,
                )
            )
        release = pool.to_release()
        written: list[int] = []
        for i, result in zip(chosen, await self.engine.transfer(requests) if requests else [], strict=True):
            r = held[i]
            assert r is not None
            if result.ok:
                written.append(i)
            else:  # its node may be gone: the master places the classic put where it can
                release.append(r.put_id)
                classic.append(i)
        if written or release:
            commit = p.BatchPutCommit(
                [keys[i] for i in written],
                [held[i].put_id for i in written],  # type: ignore[union-attr]
                opts.soft_pin,
                opts.upsert,
                self.client_id,
                pool.wanted([sizes[i] for i in written]),
                release,
            )
            reply = await self.master.call(commit)
            use_by = now + reply.ttl_s / 2
            for i, outcome in zip(written, reply.results, strict=True):
                r = held[i]
                assert r is not None
                try:
                    stored = p.unwrap(outcome)
                except YutuError as exc:
                    if exc.kind is ErrorKind.NOT_FOUND:
                        classic.append(i)  # the reservation is gone: put it the classic way
                    else:
                        results[i] = exc  # refused before it took the reservation
                        pool.add(r)
                    continue
                results[i] = bool(stored)
                if not stored:
                    pool.add(r)  # the key was stored already: the reservation is still ours
            for outcome, size in zip(reply.refills, commit.refill, strict=True):
                if outcome.error is None:
                    slot = outcome.value
                    assert slot is not None and slot.put_id is not None
                    pool.add(Reservation(slot.put_id, slot.replicas[0], size, session, use_by))
        if classic:
            classic.sort()
            again = await self.put_started([keys[i] for i in classic], [sources[i] for i in classic], opts)
            for i, outcome in zip(classic, again, strict=True):
                results[i] = outcome
        return results

    async def put_started(
        self, keys: list[str], sources: list[tuple[str, int, int]], opts: PutOptions
    ) -> list[bool | YutuError]:
        """The classic put (the reference): one put_start for all keys, every replica written in
        one transfer batch, one put_end for the keys whose writes all succeeded and one put_revoke
        for the rest."""
        msg = p.BatchPutStart(
            keys, [s[2] for s in sources], opts.replicas, opts.soft_pin, opts.upsert, self.client_id
        )
        reply = await self.master.call(msg)
        results: list[bool | YutuError] = [False] * len(keys)
        put_ids: dict[int, str] = {}
        requests: list[TransferRequest] = []
        owners: list[tuple[int, str]] = []  # (key index, segment) per request
        for i, outcome in enumerate(reply.results):
            try:
                put_id, replicas = p.unwrap(outcome)
            except YutuError as exc:
                results[i] = exc
                continue
            if put_id is None:
                continue  # already stored: nothing to write
            put_ids[i] = put_id
            region, offset, length = sources[i]
            for r in replicas:  # typed and checked when the reply was decoded
                assert r.offset is not None
                requests.append(
                    TransferRequest(TransferOp.WRITE, region, offset, r.segment, r.region, r.offset, length)
                )
                owners.append((i, r.segment))
        failed: dict[int, str] = {}
        for (i, segment), result in zip(owners, await self.engine.transfer(requests), strict=True):
            if not result.ok and i not in failed:
                failed[i] = f"writing {keys[i]!r} to segment {segment!r} failed: {result.error}"
        done = [i for i in put_ids if i not in failed]
        if done:
            ends = await self.master.call(p.BatchPutEnd([keys[i] for i in done], [put_ids[i] for i in done]))
            for i, outcome in zip(done, ends.results, strict=True):
                try:
                    p.unwrap(outcome)
                    results[i] = True
                except YutuError as exc:
                    results[i] = exc
        if failed:
            bad = list(failed)
            await self.master.call(p.BatchPutRevoke([keys[i] for i in bad], [put_ids[i] for i in bad]))
            for i in bad:
                results[i] = YutuError(
                    f"{failed[i]}; the put was revoked: put it again", ErrorKind.UNAVAILABLE
                )
        return results

    async def locate(self, keys: list[str], cached: bool = True) -> list[Located | YutuError]:
        """Replicas of every key (one RPC, under a lease), best first: same host, then the rest.

        With the lease cache on (and ``cached``), keys whose lease is still good skip the RPC.
        """
        out: list[Located | YutuError] = [_UNKNOWN] * len(keys)
        ask = list(range(len(keys)))
        now = time.monotonic()
        if self.lease_cache and cached:
            ask = []
            for i, key in enumerate(keys):
                hit = self.leases.get(key, now)
                if hit is not None:
                    out[i] = hit
                else:
                    ask.append(i)
        if not ask:
            return out
        reply = await self.master.call(
            p.BatchGetReplicas([keys[i] for i in ask] if len(ask) < len(keys) else keys)
        )
        for i, outcome in zip(ask, reply.results, strict=True):
            try:
                size, replicas = p.unwrap(outcome)  # typed and checked when the reply was decoded
            except YutuError as exc:
                out[i] = exc
                continue
            if len(replicas) > 1:
                replicas.sort(key=lambda r: r.host_id != self.host_id)  # stable: master order otherwise
            out[i] = located = (size, replicas)
            if self.lease_cache:
                self.leases.remember(keys[i], located, now, reply.lease_ttl_s)
        self.leases.prune(now, keep=4 * len(keys) + 1024)
        return out

    async def close(self) -> None:
        """Give the master back the reservations this client holds (best effort: the master
        reclaims them after its put timeout anyway)."""
        if self.reservations is None:
            return
        put_ids = self.reservations.drain(self.master.session)
        if put_ids:
            try:
                await self.master.call(p.BatchUnreserve(put_ids), timeout_s=1.0)
            except YutuError as exc:
                log.info("could not give back %d store reservations: %s", len(put_ids), exc)

    async def read(
        self,
        keys: list[str],
        located: list[Located | YutuError],
        indices: list[int],
        dests: list[tuple[str, int]],
    ) -> list[YutuError | None]:
        """READ each ``keys[indices[j]]`` (located, not an error) into ``dests[j]`` = (local
        region, offset); on a failed transfer retry from the next replica. None per read that
        succeeded, else the error naming every replica tried."""
        errors: list[YutuError | None] = [None] * len(indices)
        tried = [0] * len(indices)
        reasons: list[list[str]] = [[] for _ in indices]
        todo = list(range(len(indices)))
        while todo:
            requests = []
            for j in todo:
                size, replicas = located[indices[j]]  # type: ignore[misc]
                r = replicas[tried[j]]
                assert r.offset is not None
                requests.append(
                    TransferRequest(
                        TransferOp.READ, dests[j][0], dests[j][1], r.segment, r.region, r.offset, size
                    )
                )
            results = await self.engine.transfer(requests)
            retry = []
            for j, result in zip(todo, results, strict=True):
                if result.ok:
                    continue
                replicas = located[indices[j]][1]  # type: ignore[index]
                self.leases.forget([keys[indices[j]]])  # ask the master next time
                reasons[j].append(f"{replicas[tried[j]].segment}: {result.error}")
                tried[j] += 1
                if tried[j] < len(replicas):
                    retry.append(j)
                else:
                    errors[j] = YutuError(
                        f"every replica of {keys[indices[j]]!r} failed ({'; '.join(reasons[j])}); retry the get",
                        ErrorKind.UNAVAILABLE,
                    )
            todo = retry
        return errors
