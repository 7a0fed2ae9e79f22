"""The store master's RPC handlers: segments and heartbeats, puts, reads, removal and disk-tier
tasks.

Each handler runs the synchronous state operation and settles its effects
(:mod:`services.store_master.settle`); it returns its reply, or an awaitable of it only when it
must wait (the fast paths of :mod:`services.store_master.service`). Handlers never block the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.protocol.kv_events import AllBlocksCleared

from services.store_master.batching import Batching
from services.store_master.objects import Replica
from services.store_master.settle import EffectSettling
from services.store_master.state import NoSpaceError, check_int

log = logging.getLogger(__name__)

T = TypeVar("T")


class RpcHandlers(EffectSettling, Batching):
    """Mixin of :class:`~services.store_master.service.StoreMasterService`: one method per request
    type (the service's dispatch table maps each to its method)."""

    def _describe(self, replica: Replica) -> list[Any]:
        """The replica as a ``ReplicaDescriptor.to_wire()`` list."""
        segment = self.state.segments.get(replica.segment)
        region, host_id = ("", "") if segment is None else (segment.region, segment.host_id)
        return [  # state and medium are StrEnums: msgpack writes them as their str values
            replica.segment,
            region,
            replica.offset,
            replica.length,
            replica.state,
            host_id,
            replica.medium,
        ]

    # -- segments --------------------------------------------------------------------------------

    async def _mount(self, m: p.MountSegment) -> p.Ack:
        new = self.state.mount(
            m.node_id, m.segment, m.region, m.size, m.host_id, m.incarnation, m.disk_capacity
        )
        await self._settle()
        if new:
            log.info("mounted segment %s (%d bytes) of %s", m.segment, m.size, m.node_id)
        return p.Ack(int(new))

    def _batch_mount(self, m: p.BatchMountSegment) -> Any:
        def one(spec: Any) -> int:
            if not isinstance(spec, list) or len(spec) != 6:
                raise YutuError(
                    "a segment is [segment, region, size, host_id, incarnation, disk_capacity]",
                    ErrorKind.INVALID_REQUEST,
                )
            return int(self.state.mount(m.node_id, *spec))

        return self._settled(lambda: self._batch(m.segments, one))

    async def _unmount(self, m: p.UnmountSegment) -> p.Ack:
        dropped = self.state.unmount(m.node_id, m.segment)
        await self._settle()
        return p.Ack(dropped)

    def _batch_unmount(self, m: p.BatchUnmountSegment) -> Any:
        def one(name: Any) -> int:
            return self.state.unmount(m.node_id, name)

        return self._settled(lambda: self._batch(m.segments, one))

    def _heartbeat(self, m: p.Heartbeat) -> p.HeartbeatReply:
        if not isinstance(m.segments, list) or not all(
            isinstance(s, list) and len(s) == 2 for s in m.segments
        ):
            raise YutuError(
                "heartbeat segments must be [[segment, incarnation], ...]", ErrorKind.INVALID_REQUEST
            )
        return p.HeartbeatReply(self.state.heartbeat(m.node_id, [(str(n), i) for n, i in m.segments]))

    # -- puts ------------------------------------------------------------------------------------

    async def _with_room(self, attempt: Callable[[], T], size: int) -> T:
        """Run ``attempt`` (a state operation); on NoSpaceError evict, wait for disk moves, retry."""
        policy = self.settings.policy
        for _ in range(int(1 / policy.eviction_ratio) + 2):
            try:
                return attempt()
            except NoSpaceError:
                target = max(int(self.state.segments.capacity * policy.eviction_ratio), size)
                victims = self.state.evict(target)
                tasks = await self._settle()
                if not victims and not self._offloads_running():
                    soon = self.state.next_release_at()
                    if soon is not None and soon - self.state.clock() <= policy.lease_ttl_s:
                        await asyncio.sleep(max(0.0, soon - self.state.clock()) + 0.01)  # a lease ends: wait
                        self.state.sweep()
                        continue
                    raise YutuError(
                        f"the store is full: no room for {size} bytes and every object is leased, pinned or "
                        "being written; retry later or add store nodes",
                        ErrorKind.OVERLOADED,
                    ) from None
                waits = [t.task_id for t in tasks if t.op == "offload"] or self._offloads_running()
                await self.tasks.wait(waits)
        raise YutuError(f"could not make room for {size} bytes; retry later", ErrorKind.OVERLOADED)

    def _offloads_running(self) -> list[str]:
        return [t for t, r in self.state.disk.running.items() if r.task.op == "offload"]

    def _start_one(self, key: Any, size: Any, m: p.PutStart | p.BatchPutStart) -> Any:
        """``[put_id, replicas]``, or an awaitable of it when room must be made first."""
        check_int("size", size, 1)
        try:
            put_id, replicas = self.state.put_start(key, size, m.replicas, m.soft_pin, m.upsert, m.writer)
        except NoSpaceError:
            return self._start_slow(key, size, m)
        return self._started(put_id, replicas)

    async def _start_slow(self, key: Any, size: int, m: p.PutStart | p.BatchPutStart) -> list[Any]:
        put_id, replicas = await self._with_room(
            lambda: self.state.put_start(key, size, m.replicas, m.soft_pin, m.upsert, m.writer), size
        )
        return self._started(put_id, replicas)

    def _started(self, put_id: str | None, replicas: list[Replica]) -> list[Any]:
        if self.state.over_watermark():
            self.state.evict()
        return [put_id, [self._describe(r) for r in replicas]]

    def _put_start(self, m: p.PutStart) -> Any:
        def run() -> Any:
            value = self._start_one(m.key, m.size, m)
            if inspect.isawaitable(value):
                return self._start_reply_later(m.key, value)
            return p.PutStartReply(m.key, *value)

        return self._settled(run, durable=False)  # see the settle module's docstring

    @staticmethod
    async def _start_reply_later(key: str, value: Awaitable[list[Any]]) -> p.PutStartReply:
        put_id, replicas = await value
        return p.PutStartReply(key, put_id, replicas)

    def _batch_put_start(self, m: p.BatchPutStart) -> Any:
        if not isinstance(m.keys, list) or not isinstance(m.sizes, list) or len(m.keys) != len(m.sizes):
            raise YutuError("keys and sizes must be lists of the same length", ErrorKind.INVALID_REQUEST)
        return self._settled(
            lambda: self._batch(
                list(range(len(m.keys))), lambda i: self._start_one(m.keys[i], m.sizes[i], m)
            ),
            durable=False,
        )

    def _put_end(self, m: p.PutEnd) -> Any:
        def run() -> p.Ack:
            self.state.put_end(m.key, m.put_id)
            return p.Ack(1)

        return self._settled(run)

    def _batch_put_end(self, m: p.BatchPutEnd) -> Any:
        return self._pairs(m.keys, m.put_ids, self.state.put_end)

    def _put_revoke(self, m: p.PutRevoke) -> Any:
        def run() -> p.Ack:
            self.state.put_revoke(m.key, m.put_id)
            return p.Ack(1)

        return self._settled(run)

    def _batch_put_revoke(self, m: p.BatchPutRevoke) -> Any:
        return self._pairs(m.keys, m.put_ids, self.state.put_revoke)

    def _pairs(self, keys: Any, put_ids: Any, op: Callable[[str, str], None]) -> Any:
        if not isinstance(keys, list) or not isinstance(put_ids, list) or len(keys) != len(put_ids):
            raise YutuError("keys and put_ids must be lists of the same length", ErrorKind.INVALID_REQUEST)
        return self._settled(lambda: self._batch(list(range(len(keys))), lambda i: op(keys[i], put_ids[i])))

    # -- reads -----------------------------------------------------------------------------------

    def _replicas_of(self, key: Any) -> Any:
        """``[size, replicas]`` under a lease, or an awaitable of it when the object is on disk."""
        found = self.state.get_replicas(key)
        if found is None:
            return self._promote(key)
        size, replicas = found
        return [size, [self._describe(r) for r in replicas]]

    async def _promote(self, key: str) -> list[Any]:
        """Bring an object that is only on disk back to DRAM, then lease it."""
        entry = self.state.objects[key]
        task_id = await self._with_room(lambda: self.state.disk.start_promote(key), entry.size)
        await self._settle()
        await self.tasks.wait([task_id])
        found = self.state.get_replicas(key)
        if found is None:
            raise YutuError(f"could not bring {key!r} back from disk; retry", ErrorKind.UNAVAILABLE)
        size, replicas = found
        return [size, [self._describe(r) for r in replicas]]

    def _get_replicas(self, m: p.GetReplicas) -> Any:
        value = self._replicas_of(m.key)
        if inspect.isawaitable(value):
            return self._replicas_reply_later(m.key, value)
        size, replicas = value
        return p.ReplicasReply(m.key, size, replicas, self.settings.policy.lease_ttl_s)

    async def _replicas_reply_later(self, key: str, value: Awaitable[list[Any]]) -> p.ReplicasReply:
        size, replicas = await value
        return p.ReplicasReply(key, size, replicas, self.settings.policy.lease_ttl_s)

    def _batch_get_replicas(self, m: p.BatchGetReplicas) -> Any:
        """``_batch`` over ``_replicas_of``, unrolled: one clock read and one segment lookup per
        segment for the whole batch (the hot path of every get)."""
        keys = m.keys
        if not isinstance(keys, list):
            raise YutuError("a batch request needs a list", ErrorKind.INVALID_REQUEST)
        get_replicas = self.state.get_replicas
        now = self.state.clock()
        where: dict[str, tuple[str, str]] = {}  # segment -> (region, host_id)
        results: list[p.Outcome] = []
        for index, key in enumerate(keys):
            try:
                found = get_replicas(key, now)
            except YutuError as exc:
                results.append(p.failed(exc.kind, str(exc)))
                continue
            if found is None:  # on disk only: promote it, and serve the rest on the slow path
                return self._batch_rest(keys, self._replicas_of, results, index, self._promote(key))
            size, replicas = found
            described = []
            for r in replicas:
                seg = where.get(r.segment)
                if seg is None:
                    segment = self.state.segments.get(r.segment)
                    seg = where[r.segment] = (
                        ("", "") if segment is None else (segment.region, segment.host_id)
                    )
                # as _describe: a ReplicaDescriptor.to_wire() list (StrEnums go out as their values)
                described.append([r.segment, seg[0], r.offset, r.length, r.state, seg[1], r.medium])
            results.append([None, [size, described]])
        return p.BatchReply(results, self.settings.policy.lease_ttl_s)

    def _exists(self, m: p.Exists) -> p.ExistsReply:
        return p.ExistsReply(self.state.exists(m.key))

    def _batch_exists(self, m: p.BatchExists) -> p.BatchExistsReply:
        if not isinstance(m.keys, list):
            raise YutuError("keys must be a list", ErrorKind.INVALID_REQUEST)
        return p.BatchExistsReply([self.state.exists(k) for k in m.keys])

    def _remove(self, m: p.Remove) -> Any:
        return self._settled(lambda: p.Ack(int(self.state.remove(m.key))))

    def _batch_remove(self, m: p.BatchRemove) -> Any:
        return self._settled(lambda: self._batch(m.keys, self.state.remove))

    async def _remove_all(self, m: p.RemoveAll) -> p.Ack:
        count = self.state.remove_all()
        self.state.effects.events.append(AllBlocksCleared())
        await self._settle()
        return p.Ack(count)

    # -- disk-tier tasks -------------------------------------------------------------------------

    async def _fetch_tasks(self, m: p.FetchTasks) -> p.TasksReply:
        if not isinstance(m.node_id, str) or not isinstance(m.wait_s, int | float):
            raise YutuError("FetchTasks needs a node_id str and wait_s seconds", ErrorKind.INVALID_REQUEST)
        return p.TasksReply([t.to_wire() for t in await self.tasks.fetch(m.node_id, float(m.wait_s))])

    async def _tasks_done(self, m: p.TasksDone) -> p.Ack:
        if not isinstance(m.results, list) or not all(isinstance(r, list) and len(r) == 2 for r in m.results):
            raise YutuError("results must be [[task_id, error or None], ...]", ErrorKind.INVALID_REQUEST)
        for task_id, error in m.results:
            self.state.disk.task_done(str(task_id), None if error is None else str(error))
            self.tasks.finish(str(task_id), None if error is None else str(error))
        await self._settle()
        return p.Ack(len(m.results))
