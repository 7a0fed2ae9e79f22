"""The store master process: RPC handlers around :class:`MasterState`, persistence, KV events,
disk-tier task dispatch, housekeeping and registration.

Each handler runs the synchronous state operation, then settles its effects: they are marked for
Redis, committed, and its KV events published; disk-tier tasks go to their node's queue. Handlers
never block the loop.

Fast paths: a handler returns its reply directly when nothing needs awaiting (reads, exists,
heartbeats, and put_start), and an awaitable only when it must wait (a Redis commit, room to be
made, a disk promotion); the RPC server answers direct replies without a task.

What waits for Redis: every acknowledged change that must survive a master restart -- put_end,
revoke, remove, mounts -- is committed before its reply. A put_start's allocation is committed in
the background instead, within ``BACKGROUND_COMMIT_DELAY_S`` (its reply does not wait): the put is
not acknowledged until put_end, whose commit writes the object's current record anyway. If the master dies before that background write,
the restarted master does not know the put, the writer's put_end is refused with NOT_FOUND ("put
the object again") and the space counts as free; a restored pending put whose write did land is
reclaimed after ``put_timeout_s`` as before.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgpack
import redis.asyncio as aioredis
from fastapi import APIRouter
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.protocol.kv_events import AllBlocksCleared
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import RpcServer
from yutu.service import Service

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

# A put_start's record is written this long after it unless its put_end (whose commit writes the
# record's then-current value) comes first: one Redis write per put instead of two.
BACKGROUND_COMMIT_DELAY_S = 0.05
_PLAIN = (list, int, str, bytes, type(None))  # batch item values that are surely not awaitable


class StoreMasterService(Service):
    kind = "store-master"

    def __init__(self, settings: MasterSettings, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.settings = settings
        self.state = MasterState(settings.policy, clock)
        self.store_metrics = StoreMetrics(self.metrics, self)
        self._redis: aioredis.Redis | None = None
        self._persister: Persister | None = None
        self._rpc: RpcServer | None = None
        self._events: KVEventPublisher | None = None
        self._registration: Registration | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._ready = False
        self.tasks = TaskDispatcher()
        self._handlers: dict[type[Any], Callable[[Any], Any]] = {  # reply, or an awaitable of it
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
        if self.http_url:
            endpoints["admin"] = self.http_url
        record = ServiceRecord(
            self.kind, s.instance_id, endpoints, {"capacity": self.state.segments.capacity}
        )
        self._registration = Registration(Registry(self._redis, s.registry_prefix), record, s.registry_ttl_s)
        await self._registration.start()
        self._ready = True
        log.info("store master %s: %s", s.instance_id, endpoints)

    def _advertise(self, endpoint: str) -> str:
        host = self.settings.advertise_host
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

    def _handle(self, msg: Any) -> Any:
        """The reply to ``msg``, or an awaitable of it (see the module docstring)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise YutuError(
                f"{type(msg).__name__} is not a request the store master serves", ErrorKind.INVALID_REQUEST
            )
        op = type(msg).__name__
        started = time.perf_counter()
        try:
            reply = handler(msg)
        except YutuError as exc:
            self.store_metrics.observe(op, exc.kind.value, time.perf_counter() - started)
            raise
        if inspect.isawaitable(reply):
            return self._observed(op, started, reply)
        self.store_metrics.observe(op, "ok", time.perf_counter() - started)
        return reply

    async def _observed(self, op: str, started: float, pending: Awaitable[Any]) -> Any:
        outcome = "ok"
        try:
            return await pending
        except YutuError as exc:
            outcome = exc.kind.value
            raise
        finally:
            self.store_metrics.observe(op, outcome, time.perf_counter() - started)

    def _settle_fast(self, durable: bool = True) -> Coroutine[Any, Any, Any] | None:
        """Settle the effects so far; None when nothing is left to wait for, else a coroutine to await.

        ``durable=False``: metadata-only effects are written to Redis in the background.
        """
        effects = self.state.take_effects()
        if effects.events or effects.tasks or effects.failed_tasks:
            return self._settle_effects(effects)
        if self.settings.persist and (effects.dirty_objects or effects.dirty_segments):
            assert self._persister is not None
            self._persister.mark(effects.dirty_objects, effects.dirty_segments)
            if durable:
                return self._persister.commit()
            self._persister.commit_soon(BACKGROUND_COMMIT_DELAY_S)
        return None

    def _then(self, pending: Coroutine[Any, Any, Any] | None, reply: T) -> T | Coroutine[Any, Any, T]:
        """``reply`` once ``pending`` (if any) is done."""
        if pending is None:
            return reply

        async def later() -> T:
            await pending
            return reply

        return later()

    def _settled(self, run: Callable[[], Any], durable: bool = True) -> Any:
        """Run a state operation (it returns a reply or an awaitable of it), then settle its effects;
        the reply, or an awaitable of it when something must be waited for."""
        try:
            reply = run()
        except YutuError as exc:
            pending = self._settle_fast(durable)
            if pending is None:
                raise
            return self._raise_after(pending, exc)
        if inspect.isawaitable(reply):
            return self._settle_after(reply)
        return self._then(self._settle_fast(durable), reply)

    @staticmethod
    async def _raise_after(pending: Coroutine[Any, Any, Any], exc: YutuError) -> Any:
        await pending
        raise exc

    async def _settle_after(self, reply: Awaitable[T]) -> T:
        try:
            return await reply
        finally:
            await self._settle()

    async def _settle(self) -> list[NodeTask]:
        """Apply the effects of the operations run so far; returns the disk-tier tasks they made."""
        return await self._settle_effects(self.state.take_effects())

    async def _settle_effects(self, effects: Effects) -> list[NodeTask]:
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
        return [  # state and medium are StrEnums: msgpack writes them as their str values
            replica.segment,
            region,
            replica.offset,
            replica.length,
            replica.state,
            host_id,
            replica.medium,
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

    def _batch(self, items: list[Any], one: Callable[[Any], Any]) -> Any:
        """One outcome per item, in order; ``one`` returns a value, or an awaitable of it for the slow
        path. Returns the ``BatchReply``, or an awaitable of it once an item needed awaiting."""
        if not isinstance(items, list):
            raise YutuError("a batch request needs a list", ErrorKind.INVALID_REQUEST)
        results: list[p.Outcome] = []
        for index, item in enumerate(items):
            try:
                value = one(item)
            except YutuError as exc:
                results.append(p.failed(exc.kind, str(exc)))
                continue
            if not isinstance(value, _PLAIN) and inspect.isawaitable(value):
                return self._batch_rest(items, one, results, index, value)
            results.append([None, value])
        return p.BatchReply(results, self.settings.policy.lease_ttl_s)

    async def _batch_rest(
        self, items: list[Any], one: Callable[[Any], Any], results: list[p.Outcome], index: int, first: Any
    ) -> p.BatchReply:
        """``_batch`` from ``items[index]`` on, for which ``one`` returned the awaitable ``first``."""
        for item in items[index:]:
            try:
                value = first if first is not None else one(item)
                first = None
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

        return self._settled(run, durable=False)  # see the module docstring

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

    # -- reporting -------------------------------------------------------------------------------

    def _get_stats(self, m: p.GetStats) -> p.StatsReply:
        return p.StatsReply(self.stats())

    def stats(self) -> dict[str, Any]:
        return collect_stats(self.state, self._persister, self._events)
