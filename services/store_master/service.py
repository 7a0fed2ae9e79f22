"""The store master process: the RPC server over the master's collaborators, persistence, KV
events, disk-tier task dispatch, housekeeping and registration.

Collaborators, each with a narrow job: :class:`~services.store_master.state.MasterState` (the
metadata and its operations), :class:`~services.store_master.settle.Settler` (effects to Redis,
KV events and nodes), :class:`~services.store_master.room.Room` (evict and wait when full),
:class:`~services.store_master.tasks.TaskDispatcher` (disk-tier tasks to nodes) and
:class:`~services.store_master.handlers.Handlers` (one ``async`` method per request). Requests
are run eagerly (:mod:`services.store_master.eager`): a handler that finishes without waiting is
answered without a task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from types import CoroutineType
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.protocol.kv_events import AllBlocksCleared, BlockHash, BlockStored, KVEvent, key_to_hash
from yutu.redis_conn import connect
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.rpc import KVEventPublisher, RpcServer
from yutu.rpc.stream import StreamRpcServer
from yutu.service import Service
from yutu.supervise import cancel_and_wait

from services.store_master.admin import build_router
from services.store_master.eager import run_eager
from services.store_master.handlers import Handler, Handlers
from services.store_master.metrics import StoreMetrics, collect_stats
from services.store_master.persistence import MetadataStore, Persister, object_record, segment_record
from services.store_master.resync import MetadataWatch
from services.store_master.room import Room
from services.store_master.settings import MasterSettings
from services.store_master.settle import Settler
from services.store_master.state import MasterState
from services.store_master.tasks import TaskDispatcher

log = logging.getLogger(__name__)


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
        self._stream: StreamRpcServer | None = None  # the same RPC without ZeroMQ's thread hops
        self._events: KVEventPublisher | None = None
        self._registration: Registration | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._watch: MetadataWatch | None = None  # rewrites the metadata into a Redis that lost it
        self._watcher: asyncio.Task[None] | None = None
        self._ready = False
        self.tasks = TaskDispatcher()
        self.settler = Settler(self.state, None, None, self.tasks)  # Redis and events join at startup
        self.handlers = Handlers(
            self.state, self.settler, Room(self.state, self.settler, self.tasks), self.tasks
        )
        self._routes: dict[type[Any], Handler] = {**self.handlers.routes(), p.GetStats: self._get_stats}

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        self._redis = connect(s.redis_url)
        await self._redis.ping()
        store = MetadataStore(self._redis, s.registry_prefix)
        if s.persist:
            segments, objects = await store.load()
            self.state.restore(segments, objects)
            log.info(
                "recovered %d segments and %d objects from Redis", len(segments), len(self.state.objects)
            )
        self._persister = Persister(
            store, lambda key: object_record(self.state, key), lambda name: segment_record(self.state, name)
        )
        if s.persist:
            self.settler.persister = self._persister
        if s.persist:
            self._watch = MetadataWatch(
                self._redis, s.registry_prefix, self._persister, self._record_names, s.instance_id
            )
            await self._watch.arm()
        if s.kv_events:
            self._events = KVEventPublisher(
                s.host, s.kv_events_port, s.kv_events_topic, s.data_parallel_rank, s.kv_events_replay_port,
                snapshot=self._events_snapshot,
            )  # fmt: skip
            self.settler.events = self._events
            replay = self._events.start()
            if replay is not None:
                self.loops.watch("kv-events-replay", replay)
        self._rpc = RpcServer(p.CHANNEL, self._handle, s.host, s.port)
        self._rpc.start()
        if s.stream_port is not None:
            self._stream = StreamRpcServer(
                p.CHANNEL, self._handle, s.host, s.stream_port, spin_s=s.spin_us / 1e6
            )
            await self._stream.start()
        self._sweeper = self.loops.spawn("store-sweeper", self._sweep_loop())
        if self._watch is not None:
            self._watcher = self.loops.spawn("metadata-watch", self._watch.run())
        endpoints = {"rpc": self._advertise(self._rpc.endpoint)}
        if self._stream is not None:
            endpoints["rpc_stream"] = self._advertise(self._stream.endpoint)
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
        await cancel_and_wait([t for t in (self._sweeper, self._watcher) if t is not None], "store master")
        if self._rpc is not None:
            await self._rpc.close()
        if self._stream is not None:
            await self._stream.close()
        await self.settler.close()  # KV events held for the write-behind window go out first
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
        """The RPC server's handler: the reply to ``msg`` when its handler finished without
        waiting, else an awaitable of it (see :mod:`services.store_master.eager`)."""
        handler = self._routes.get(type(msg))
        if handler is None:
            raise YutuError(
                f"{type(msg).__name__} is not a request the store master serves", ErrorKind.INVALID_REQUEST
            )
        op = type(msg).__name__
        started = time.perf_counter()
        try:
            reply: Any = run_eager(handler(msg))  # type: ignore[arg-type]  # every handler is an async def
        except YutuError as exc:
            self.store_metrics.observe(op, exc.kind.value, time.perf_counter() - started)
            raise
        if type(reply) is CoroutineType:  # it waits: the rest runs as the RPC server's task
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

    # -- housekeeping ----------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                self.state.sweep()
                await self.settler.settle()
            except YutuError as exc:
                log.warning("housekeeping: %s", exc)
            except Exception:  # noqa: BLE001 - housekeeping must keep running
                log.exception("housekeeping failed")

    # -- reporting -------------------------------------------------------------------------------

    async def _get_stats(self, m: p.GetStats) -> p.StatsReply:
        return p.StatsReply(self.stats())

    def stats(self) -> dict[str, Any]:
        rewrites = 0 if self._watch is None else self._watch.rewrites
        return {**collect_stats(self.state, self._persister, self._events), "metadata_rewrites": rewrites}

    def _events_snapshot(self) -> list[KVEvent]:
        """What a KV-event replay from the start sends: every readable object, as one batch."""
        keys: list[BlockHash] = [key_to_hash(k) for k, e in self.state.objects.items() if e.readable]
        events: list[KVEvent] = [AllBlocksCleared()]
        if keys:
            events.append(BlockStored(keys, block_size=self.state.policy.block_size))
        return events

    def _record_names(self) -> tuple[set[str], set[str]]:
        """Every object and segment the master holds (what a full metadata rewrite writes)."""
        return set(self.state.objects), set(self.state.segments.segments)
