"""The store master's RPC handlers: segments and heartbeats, puts, reads, removal and disk-tier
tasks -- one plain ``async`` method per request type.

Each handler runs a synchronous state operation and settles its effects
(:mod:`services.store_master.settle`); handlers never block the loop. Most finish without
waiting, and the service runs them eagerly (:mod:`services.store_master.eager`), so those replies
cost no task. Nested parts of requests arrive typed and checked (:mod:`yutu.protocol.store`);
flat fields (keys, sizes, ids) are checked here or by the state.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.store.types import ReplicaState

from services.store_master.batching import each
from services.store_master.objects import Replica
from services.store_master.replies import descriptors
from services.store_master.room import Room
from services.store_master.settle import Durability, Settler
from services.store_master.state import MasterState, NoSpaceError, check_int
from services.store_master.tasks import TaskDispatcher

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[Any]]


def _lists(what: str, *values: Any) -> None:
    """INVALID_REQUEST unless every value is a list, all of the same length."""
    if not all(isinstance(v, list) for v in values) or len({len(v) for v in values}) > 1:
        raise YutuError(f"{what} must be lists of the same length", ErrorKind.INVALID_REQUEST)


class Handlers:
    """The request handlers over the master's state and the collaborators that settle effects,
    make room and hand tasks to nodes. :meth:`routes` is the dispatch table."""

    def __init__(self, state: MasterState, settler: Settler, room: Room, tasks: TaskDispatcher) -> None:
        self.state = state
        self.settler = settler
        self.room = room
        self.tasks = tasks
        self.lease_ttl_s = state.policy.lease_ttl_s

    def routes(self) -> dict[type[Any], Handler]:
        return {
            p.MountSegment: self.mount,
            p.BatchMountSegment: self.batch_mount,
            p.UnmountSegment: self.unmount,
            p.BatchUnmountSegment: self.batch_unmount,
            p.Heartbeat: self.heartbeat,
            p.PutStart: self.put_start,
            p.BatchPutStart: self.batch_put_start,
            p.PutEnd: self.put_end,
            p.BatchPutEnd: self.batch_put_end,
            p.PutRevoke: self.put_revoke,
            p.BatchPutRevoke: self.batch_put_revoke,
            p.BatchReserve: self.batch_reserve,
            p.BatchPutCommit: self.batch_put_commit,
            p.BatchUnreserve: self.batch_unreserve,
            p.GetReplicas: self.get_replicas,
            p.BatchGetReplicas: self.batch_get_replicas,
            p.Exists: self.exists,
            p.BatchExists: self.batch_exists,
            p.Remove: self.remove,
            p.BatchRemove: self.batch_remove,
            p.RemoveAll: self.remove_all,
            p.FetchTasks: self.fetch_tasks,
            p.TasksDone: self.tasks_done,
        }

    async def _settled(self, durability: Durability = Durability.NOW) -> None:
        await self.settler.settle(durability)

    # -- segments --------------------------------------------------------------------------------

    async def mount(self, m: p.MountSegment) -> p.Ack:
        try:
            new = self.state.mount(m.node_id, m.segment, m.region, m.size, m.host_id, m.incarnation,
                                   m.disk_capacity)  # fmt: skip
        finally:
            await self._settled()
        if new:
            log.info("mounted segment %s (%d bytes) of %s", m.segment, m.size, m.node_id)
        return p.Ack(int(new))

    async def batch_mount(self, m: p.BatchMountSegment) -> p.BatchReply:
        results = await each(m.segments, lambda spec: int(self.state.mount(m.node_id, *spec)))
        await self._settled()
        return p.BatchReply(results)

    async def unmount(self, m: p.UnmountSegment) -> p.Ack:
        try:
            dropped = self.state.unmount(m.node_id, m.segment)
        finally:
            await self._settled()
        return p.Ack(dropped)

    async def batch_unmount(self, m: p.BatchUnmountSegment) -> p.BatchReply:
        _lists("segments", m.segments)
        results = await each(m.segments, lambda name: self.state.unmount(m.node_id, name))
        await self._settled()
        return p.BatchReply(results)

    async def heartbeat(self, m: p.Heartbeat) -> p.HeartbeatReply:
        return p.HeartbeatReply(self.state.heartbeat(m.node_id, m.segments))

    # -- puts ------------------------------------------------------------------------------------

    def _start(self, key: Any, size: Any, m: p.PutStart | p.BatchPutStart) -> p.PutSlot:
        """Allocate ``key``'s replicas; raises NoSpaceError when no segment has room."""
        check_int("size", size, 1)
        put_id, replicas = self.state.put_start(key, size, m.replicas, m.soft_pin, m.upsert, m.writer)
        if self.state.over_watermark():
            self.state.evict()
        return p.PutSlot(put_id, descriptors(self.state.segments, replicas))

    async def _start_with_room(self, key: Any, size: Any, m: p.PutStart | p.BatchPutStart) -> p.PutSlot:
        return await self.room.make(lambda: self._start(key, size, m), size)

    async def put_start(self, m: p.PutStart) -> p.PutStartReply:
        try:
            try:
                slot = self._start(m.key, m.size, m)
            except NoSpaceError:
                slot = await self._start_with_room(m.key, m.size, m)
        finally:
            await self._settled(Durability.SOON)  # see the settle module's docstring
        return p.PutStartReply(m.key, slot.put_id, slot.replicas)

    async def batch_put_start(self, m: p.BatchPutStart) -> p.BatchPutStartReply:
        _lists("keys and sizes", m.keys, m.sizes)
        try:
            results = await each(
                list(zip(m.keys, m.sizes, strict=True)),
                lambda ks: self._start(ks[0], ks[1], m),
                lambda ks: self._start_with_room(ks[0], ks[1], m),
            )
        finally:
            await self._settled(Durability.SOON)
        return p.BatchPutStartReply(results)

    async def put_end(self, m: p.PutEnd) -> p.Ack:
        released = True  # a failed put_end settles NOW, as before
        try:
            released = self.state.put_end(m.key, m.put_id)
        finally:
            await self._settled(Durability.NOW if released else Durability.BEHIND)
        return p.Ack(1)

    async def batch_put_end(self, m: p.BatchPutEnd) -> p.BatchReply:
        """Each key's put_end; written behind unless one of them released space (see settle)."""
        _lists("keys and put_ids", m.keys, m.put_ids)
        released = False

        def one(pair: tuple[str, str]) -> int:
            nonlocal released
            released = self.state.put_end(*pair) or released
            return 1

        results = await each(list(zip(m.keys, m.put_ids, strict=True)), one)
        await self._settled(Durability.NOW if released else Durability.BEHIND)
        return p.BatchReply(results)

    async def put_revoke(self, m: p.PutRevoke) -> p.Ack:
        try:
            self.state.put_revoke(m.key, m.put_id)
        finally:
            await self._settled()
        return p.Ack(1)

    async def batch_put_revoke(self, m: p.BatchPutRevoke) -> p.BatchReply:
        return await self._pairs(m.keys, m.put_ids, self.state.put_revoke)

    async def _pairs(self, keys: Any, put_ids: Any, op: Callable[[str, str], None]) -> p.BatchReply:
        _lists("keys and put_ids", keys, put_ids)

        def one(pair: tuple[str, str]) -> int:
            op(*pair)
            return 1

        results = await each(list(zip(keys, put_ids, strict=True)), one)
        await self._settled()
        return p.BatchReply(results)

    # -- reservations (puts keyed at the end: see services.store_master.puts) ---------------------

    def _reserve(self, size: Any, writer: Any) -> p.PutSlot:
        """One reservation; raises NoSpaceError when no segment has room."""
        pending = self.state.reserve(size, writer)
        if self.state.over_watermark():
            self.state.evict()
        return p.PutSlot(pending.put_id, descriptors(self.state.segments, pending.replicas))

    async def batch_reserve(self, m: p.BatchReserve) -> p.BatchReserveReply:
        _lists("sizes", m.sizes)
        try:
            results = await each(
                m.sizes,
                lambda size: self._reserve(size, m.writer),
                lambda size: self.room.make(lambda: self._reserve(size, m.writer), size),
            )
        finally:
            await self._settled(Durability.SOON)  # nothing to persist unless it evicted
        return p.BatchReserveReply(results, self.state.policy.put_timeout_s)

    async def batch_put_commit(self, m: p.BatchPutCommit) -> p.BatchPutCommitReply:
        """Each key's commit, then the releases and the refills (which do not wait for room: a
        writer without a reservation puts the classic way). Written behind like put_end unless a
        commit released space or a refill evicted (see settle)."""
        _lists("keys and put_ids", m.keys, m.put_ids)
        _lists("refill", m.refill)
        _lists("releases", m.release)
        released = False
        rounds = self.state.counters.eviction_rounds

        def one(pair: tuple[str, str]) -> int:
            nonlocal released
            done = self.state.commit(pair[0], pair[1], m.soft_pin, m.upsert)
            released = bool(done) or released
            return int(done is not None)

        try:
            results = await each(list(zip(m.keys, m.put_ids, strict=True)), one)
            await each(m.release, self.state.unreserve)  # one already reclaimed is gone all the same
            refills = await each(m.refill, lambda size: self._reserve(size, m.writer))
        finally:
            evicted = self.state.counters.eviction_rounds != rounds
            await self._settled(Durability.NOW if released or evicted else Durability.BEHIND)
        return p.BatchPutCommitReply(results, refills, self.state.policy.put_timeout_s)

    async def batch_unreserve(self, m: p.BatchUnreserve) -> p.BatchReply:
        _lists("put_ids", m.put_ids)

        def one(put_id: str) -> int:
            self.state.unreserve(put_id)
            return 1

        return p.BatchReply(await each(m.put_ids, one))

    # -- reads -----------------------------------------------------------------------------------

    async def _promote(self, key: str) -> tuple[int, list[Replica]]:
        """Bring an object that is only on disk back to DRAM (the one read that waits), then lease it."""
        entry = self.state.objects[key]
        task_id = await self.room.make(lambda: self.state.disk.start_promote(key), entry.size)
        await self._settled()
        await self.tasks.wait([task_id])
        found = self.state.get_replicas(key)
        if found is None:
            raise YutuError(f"could not bring {key!r} back from disk; retry", ErrorKind.UNAVAILABLE)
        return found

    async def get_replicas(self, m: p.GetReplicas) -> p.ReplicasReply:
        found = self.state.get_replicas(m.key)
        if found is None:
            found = await self._promote(m.key)
        return p.ReplicasReply(m.key, found[0], descriptors(self.state.segments, found[1]), self.lease_ttl_s)

    async def batch_get_replicas(self, m: p.BatchGetReplicas) -> p.BatchReplicasReply:
        """The hot path of every get: one clock read for the whole batch, descriptors kept on the
        replicas; a key only on disk waits for its promotion (the others keep their order)."""
        _lists("keys", m.keys)
        segments, now = self.state.segments, self.state.clock()
        get_replicas, new = self.state.get_replicas, tuple.__new__
        complete = ReplicaState.COMPLETE.value  # as kept descriptors hold it
        results: list[p.Outcome[p.ReplicaSet]] = []
        for key in m.keys:
            try:
                found = get_replicas(key, now)
                if found is None:
                    found = await self._promote(key)
                    now = self.state.clock()  # time passed
            except YutuError as exc:
                results.append(p.failed(exc.kind, str(exc)))
                continue
            # descriptors(segments, found[1]) inline: readers get COMPLETE replicas, whose kept
            # descriptor is current once built (see services.store_master.replies)
            described = []
            for r in found[1]:
                d = r.descriptor
                if d is None or d[4] != complete:
                    (d,) = descriptors(segments, [r])
                described.append(d)
            # p.Outcome(None, p.ReplicaSet(...)) without their generated __new__ (once per key)
            results.append(new(p.Outcome, (None, new(p.ReplicaSet, (found[0], described)))))
        return p.BatchReplicasReply(results, self.lease_ttl_s)

    async def exists(self, m: p.Exists) -> p.ExistsReply:
        return p.ExistsReply(self.state.exists(m.key))

    async def batch_exists(self, m: p.BatchExists) -> p.BatchExistsReply:
        _lists("keys", m.keys)
        return p.BatchExistsReply([self.state.exists(k) for k in m.keys])

    async def remove(self, m: p.Remove) -> p.Ack:
        removed = self.state.remove(m.key)
        await self._settled()
        return p.Ack(int(removed))

    async def batch_remove(self, m: p.BatchRemove) -> p.BatchReply:
        _lists("keys", m.keys)
        results = await each(m.keys, lambda key: int(self.state.remove(key)))
        await self._settled()
        return p.BatchReply(results)

    async def remove_all(self, m: p.RemoveAll) -> p.Ack:
        count = self.state.remove_all()
        await self._settled()
        return p.Ack(count)

    # -- disk-tier tasks -------------------------------------------------------------------------

    async def fetch_tasks(self, m: p.FetchTasks) -> p.TasksReply:
        if not isinstance(m.node_id, str) or not isinstance(m.wait_s, int | float):
            raise YutuError("FetchTasks needs a node_id str and wait_s seconds", ErrorKind.INVALID_REQUEST)
        tasks = await self.tasks.fetch(m.node_id, float(m.wait_s))
        return p.TasksReply(
            [p.DiskTask(t.task_id, t.op, t.segment, t.key, t.offset, t.length) for t in tasks]
        )

    async def tasks_done(self, m: p.TasksDone) -> p.Ack:
        for task_id, error in m.results:
            self.state.disk.task_done(task_id, error)
            self.tasks.finish(task_id, error)
        await self._settled()
        return p.Ack(len(m.results))
