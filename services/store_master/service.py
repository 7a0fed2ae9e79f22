"""The store master process: RPC handlers around :class:`MasterState`, persistence, KV events,
disk-tier task dispatch, housekeeping and registration.

Each handler runs the synchronous state operation, then ``_settle``: the operation's effects are
marked for Redis, committed (the reply waits for it), and its KV events published; disk-tier tasks
go to their node's queue. Handlers never block the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgpack
import redis.asyncio as aioredis
from fastapi import APIRouter
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.protocol.kv_events import AllBlocksCleared
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import RpcServer
from yutu.service import Service, advertised

from services.store_master.admin import build_router
from services.store_master.events import KVEventPublisher
from services.store_master.metrics import StoreMetrics, collect_stats
from services.store_master.objects import NodeTask, Replica
from services.store_master.persistence import MetadataStore, Persister
from services.store_master.settings import MasterSettings
from services.store_master.state import Effects, MasterState, NoSpaceError, check_int
from services.store_master.tasks import TaskDispatcher

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreMasterService(Service):
    kind = "store-master"

    def __init__(self, settings: MasterSettings, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.settings = settings
        self.state = MasterState(settings.policy, clock)
        self.store_metrics = StoreMetrics(self.metrics, self)
        self.admin_url = ""
        self._redis: aioredis.Redis | None = None
        self._persister: Persister | None = None
        self._rpc: RpcServer | None = None
        self._events: KVEventPublisher | None = None
        self._registration: Registration | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._ready = False
        self.tasks = TaskDispatcher()
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[Any]]] = {
            p.MountSegment: self._mount,
            p.BatchMountSegment: self._batch_mount,
            p.UnmountSegment: self._unmount,
            p.BatchUnmountSegment: self._batch_unmount,
            p.Heartbeat: self._heartbeat,
            p.PutStart: self._put_start,
            p.BatchPutStart: self._batch_put_start,
            p.PutEnd: self._put_end,
            p.BatchPutEnd: self._batch_put_end,
            p.PutRevoke: self._put_revoke,
            p.BatchPutRevoke: self._batch_put_revoke,
            p.GetReplicas: self._get_replicas,
            p.BatchGetReplicas: self._batch_get_replicas,
            p.Exists: self._exists,
            p.BatchExists: self._batch_exists,
            p.Remove: self._remove,
            p.BatchRemove: self._batch_remove,
            p.RemoveAll: self._remove_all,
            p.FetchTasks: self._fetch_tasks,
            p.TasksDone: self._tasks_done,
            p.GetStats: self._get_stats,
        }

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        self._redis = aioredis.from_url(s.redis_url)
        await self._redis.ping()
        store = MetadataStore(self._redis, s.registry_prefix)
        if s.persist:
            segments, objects = await store.load()
            self.state.restore(segments, objects)
            log.info(
                "recovered %d segments and %d objects from Redis", len(segments), len(self.state.objects)
            )
        self._persister = Persister(store, self._snapshot_object, self._snapshot_segment)
        if s.kv_events:
            self._events = KVEventPublisher(
                s.host, s.kv_events_port, s.kv_events_topic, s.data_parallel_rank, s.kv_events_replay_port
            )
            self._events.start()
        self._rpc = RpcServer(p.CHANNEL, self._handle, s.host, s.port)
        self._rpc.start()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="store-sweeper")
        endpoints = {"rpc": self._advertise(self._rpc.endpoint)}
        if self._events is not None:
            endpoints["kv_events"] = self._advertise(self._events.endpoint)
            if self._events.replay_endpoint is not None:
                endpoints["kv_events_replay"] = self._advertise(self._events.replay_endpoint)
        if self.admin_url:
            endpoints["admin"] = self.admin_url
        record = ServiceRecord(
            self.kind, s.instance_id, endpoints, {"capacity": self.state.segments.capacity}
        )
        self._registration = Registration(Registry(self._redis, s.registry_prefix), record, s.registry_ttl_s)
        await self._registration.start()
        self._ready = True
        log.info("store master %s: %s", s.instance_id, endpoints)

    def _advertise(self, endpoint: str) -> str:
        host = advertised(self.settings.host, self.settings.advertise_host)
        return f"tcp://{host}:{endpoint.rsplit(':', 1)[1]}"

    async def drain(self) -> None:
        self._ready = False

    async def shutdown(self) -> None:
        self._ready = False
        if self._registration is not None:
            await self._registration.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._rpc is not None:
            await self._rpc.close()
        if self._persister is not None:
            await self._persister.close()
        if self._events is not None:
            await self._events.close()
        self.tasks.close()
        if self._redis is not None:
            await self._redis.aclose()

    def is_ready(self) -> bool:
        return self._ready

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "instance_id": self.settings.instance_id, **self.stats()}

    def admin_router(self) -> APIRouter:
        return build_router(self)

    # -- plumbing --------------------------------------------------------------------------------

    async def _handle(self, msg: Any) -> Any:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise YutuError(
                f"{type(msg).__name__} is not a request the store master serves", ErrorKind.INVALID_REQUEST
            )
        op = type(msg).__name__
        started = time.perf_counter()
        outcome = "ok"
        try:
            return await handler(msg)
        except YutuError as exc:
            outcome = exc.kind.value
            raise
        finally:
            self.store_metrics.observe(op, outcome, time.perf_counter() - started)

    async def _settle(self) -> list[NodeTask]:
        """Apply the effects of the operations run so far; returns the disk-tier tasks they made."""
        effects: Effects = self.state.take_effects()
        assert self._persister is not None
        if self.settings.persist and (effects.dirty_objects or effects.dirty_segments):
            self._persister.mark(effects.dirty_objects, effects.dirty_segments)
            await self._persister.commit()
        if self._events is not None and effects.events:
            await self._events.publish(effects.events)
        self.tasks.enqueue(effects.tasks)
        for task_id in effects.failed_tasks:
            self.tasks.finish(task_id, "the node holding the segment was lost")
        return effects.tasks

    def _snapshot_object(self, key: str) -> bytes | None:
        entry = self.state.objects.get(key)
        return None if entry is None else msgpack.packb(entry.to_wire(), use_bin_type=True)

    def _snapshot_segment(self, name: str) -> bytes | None:
        segment = self.state.segments.get(name)
        return None if segment is None else msgpack.packb(segment.to_wire(), use_bin_type=True)

    def _describe(self, replica: Replica) -> list[Any]:
        """The replica as a ``ReplicaDescriptor.to_wire()`` list."""
        segment = self.state.segments.get(replica.segment)
        region, host_id = ("", "") if segment is None else (segment.region, segment.host_id)
        return [
            replica.segment,
            region,
            replica.offset,
            replica.length,
            replica.state.value,
            host_id,
            replica.medium.value,
        ]

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                self.state.sweep()
                await self._settle()
            except YutuError as exc:
                log.warning("housekeeping: %s", exc)
            except Exception:  # noqa: BLE001 - housekeeping must keep running
                log.exception("housekeeping failed")

    async def _batch(self, items: list[Any], one: Callable[[Any], Any]) -> p.BatchReply:
        """One outcome per item; ``one`` returns a value, or an awaitable of it for the slow path."""
        if not isinstance(items, list):
            raise YutuError("a batch request needs a list", ErrorKind.INVALID_REQUEST)
        results: list[p.Outcome] = []
        for item in items:
            try:
                value = one(item)
                if inspect.isawaitable(value):
                    value = await value
                results.append([None, value])
            except YutuError as exc:
                results.append(p.failed(exc.kind, str(exc)))
        return p.BatchReply(results, self.settings.policy.lease_ttl_s)

    # -- segments --------------------------------------------------------------------------------

    async def _mount(self, m: p.MountSegment) -> p.Ack:
        new = self.state.mount(
            m.node_id, m.segment, m.region, m.size, m.host_id, m.incarnation, m.disk_capacity
        )
        await self._settle()
        if new:
            log.info("mounted segment %s (%d bytes) of %s", m.segment, m.size, m.node_id)
        return p.Ack(int(new))

    async def _batch_mount(self, m: p.BatchMountSegment) -> p.BatchReply:
        async def one(spec: Any) -> int:
            if not isinstance(spec, list) or len(spec) != 6:
                raise YutuError(
                    "a segment is [segment, region, size, host_id, incarnation, disk_capacity]",
                    ErrorKind.INVALID_REQUEST,
                )
            return int(self.state.mount(m.node_id, *spec))

        reply = await self._batch(m.segments, one)
        await self._settle()
        return reply

    async def _unmount(self, m: p.UnmountSegment) -> p.Ack:
        dropped = self.state.unmount(m.node_id, m.segment)
        await self._settle()
        return p.Ack(dropped)

    async def _batch_unmount(self, m: p.BatchUnmountSegment) -> p.BatchReply:
        async def one(name: Any) -> int:
            return self.state.unmount(m.node_id, name)

        reply = await self._batch(m.segments, one)
        await self._settle()
        return reply

    async def _heartbeat(self, m: p.Heartbeat) -> p.HeartbeatReply:
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

    async def _put_start(self, m: p.PutStart) -> p.PutStartReply:
        try:
            value = self._start_one(m.key, m.size, m)
            put_id, replicas = await value if inspect.isawaitable(value) else value
        finally:
            await self._settle()
        return p.PutStartReply(m.key, put_id, replicas)

    async def _batch_put_start(self, m: p.BatchPutStart) -> p.BatchReply:
        if not isinstance(m.keys, list) or not isinstance(m.sizes, list) or len(m.keys) != len(m.sizes):
            raise YutuError("keys and sizes must be lists of the same length", ErrorKind.INVALID_REQUEST)
        try:
            return await self._batch(
                list(range(len(m.keys))), lambda i: self._start_one(m.keys[i], m.sizes[i], m)
            )
        finally:
            await self._settle()

    async def _put_end(self, m: p.PutEnd) -> p.Ack:
        self.state.put_end(m.key, m.put_id)
        await self._settle()
        return p.Ack(1)

    async def _batch_put_end(self, m: p.BatchPutEnd) -> p.BatchReply:
        return await self._pairs(m.keys, m.put_ids, self.state.put_end)

    async def _put_revoke(self, m: p.PutRevoke) -> p.Ack:
        self.state.put_revoke(m.key, m.put_id)
        await self._settle()
        return p.Ack(1)

    async def _batch_put_revoke(self, m: p.BatchPutRevoke) -> p.BatchReply:
        return await self._pairs(m.keys, m.put_ids, self.state.put_revoke)

    async def _pairs(self, keys: Any, put_ids: Any, op: Callable[[str, str], None]) -> p.BatchReply:
        if not isinstance(keys, list) or not isinstance(put_ids, list) or len(keys) != len(put_ids):
            raise YutuError("keys and put_ids must be lists of the same length", ErrorKind.INVALID_REQUEST)
        reply = await self._batch(list(range(len(keys))), lambda i: op(keys[i], put_ids[i]))
        await self._settle()
        return reply

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

    async def _get_replicas(self, m: p.GetReplicas) -> p.ReplicasReply:
        value = self._replicas_of(m.key)
        size, replicas = await value if inspect.isawaitable(value) else value
        return p.ReplicasReply(m.key, size, replicas, self.settings.policy.lease_ttl_s)

    async def _batch_get_replicas(self, m: p.BatchGetReplicas) -> p.BatchReply:
        return await self._batch(m.keys, self._replicas_of)

    async def _exists(self, m: p.Exists) -> p.ExistsReply:
        return p.ExistsReply(self.state.exists(m.key))

    async def _batch_exists(self, m: p.BatchExists) -> p.BatchExistsReply:
        if not isinstance(m.keys, list):
            raise YutuError("keys must be a list", ErrorKind.INVALID_REQUEST)
        return p.BatchExistsReply([self.state.exists(k) for k in m.keys])

    async def _remove(self, m: p.Remove) -> p.Ack:
        removed = self.state.remove(m.key)
        await self._settle()
        return p.Ack(int(removed))

    async def _batch_remove(self, m: p.BatchRemove) -> p.BatchReply:
        reply = await self._batch(m.keys, self.state.remove)
        await self._settle()
        return reply

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

    # -- reporting -------------------------------------------------------------------------------

    async def _get_stats(self, m: p.GetStats) -> p.StatsReply:
        return p.StatsReply(self.stats())

    def stats(self) -> dict[str, Any]:
        return collect_stats(self.state, self._persister, self._events)
