"""The store node process: a transfer-engine segment with one DRAM region, mounted on the master.

    start engine (serves reads and writes of the region to any peer) -> mount on the master ->
    heartbeat every interval (remount when the master says it does not know it; yutu.store.mount) ->
    [disk tier] long-poll the master for offload / promote / drop tasks and run them in a thread

Ready once the segment is mounted. On SIGTERM the segment is unmounted (its objects leave the
pool) and the engine closes. A node killed outright is dropped by the master after its TTL, and
its shared-memory file is reclaimed by the next node (or ``yutu up``) that starts on the host.

Shutdown never raises because the master or Redis went first (a terminal's Ctrl-C stops them all
at once): each step logs what it could not do and the next goes on; the region is unlinked on
every path out of the process except SIGKILL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter
from yutu.protocol import store as p
from yutu.redis_conn import connect
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.service import Service
from yutu.store.master import MasterClient
from yutu.store.mount import UNREACHABLE, MountedSegment
from yutu.supervise import cancel_and_wait
from yutu.transfer import Region, SegmentDirectory, TransferEngine
from yutu.transfer.region import reclaim_stale_regions
from yutu.transfer.tcp_wire import congestion_flag

from services.store_node.disk import DiskTierFiles
from services.store_node.settings import REGION_NAME, NodeSettings

log = logging.getLogger(__name__)

TASK_POLL_S = 10.0


class StoreNodeService(Service):
    kind = "store-node"

    def __init__(self, settings: NodeSettings) -> None:
        super().__init__()
        self.settings = settings
        self.mount: MountedSegment | None = None
        self.region: Region | None = None
        self.engine: TransferEngine | None = None
        self.master: MasterClient | None = None
        self.disk = (
            None if settings.disk_dir is None else DiskTierFiles(settings.disk_dir, settings.disk_capacity)
        )
        self.tasks_done = {"offload": 0, "promote": 0, "drop": 0, "failed": 0}
        self._redis: aioredis.Redis | None = None
        self._registration: Registration | None = None
        self._loop_tasks: list[asyncio.Task[Any]] = []  # supervised by self.loops; cancelled first

    @property
    def incarnation(self) -> int:
        assert self.engine is not None
        return self.engine.descriptor().incarnation

    async def startup(self) -> None:
        s = self.settings
        self._redis = connect(s.redis_url)  # survives a Redis restart (yutu.redis_conn)
        await self._redis.ping()
        registry = Registry(self._redis, s.registry_prefix)
        directory = SegmentDirectory(self._redis, s.registry_prefix)
        host = s.advertise_host
        self.engine = TransferEngine(
            s.segment_name,
            directory,
            s.host,
            s.transfer_port,
            s.tcp_connections,
            transports=s.transports,
            advertise_host=host,
            tcp_congestion=s.tcp_congestion,
        )
        await asyncio.to_thread(reclaim_stale_regions)  # files of nodes killed outright
        self.region = self.engine.register_region(REGION_NAME, s.segment_size)
        if s.prefault:
            await asyncio.to_thread(self.region.fault_in, "segment")
        await self.engine.start()
        if self.disk is not None:
            stale = await asyncio.to_thread(self.disk.clear)
            if stale:
                log.info("removed %d stale disk-tier files from %s", stale, self.disk.directory)
        self.master = MasterClient(
            s.master, None if s.master else registry, timeout_s=max(2.0, s.heartbeat_interval_s)
        )
        self.mount = MountedSegment(
            self.master, s.instance_id, s.segment_name, REGION_NAME, s.segment_size, self.incarnation,
            s.disk_capacity, s.heartbeat_interval_s,
        )  # fmt: skip
        heartbeat = self.mount.start()  # mounts (retrying until the master answers), then heartbeats
        self.loops.watch("store-heartbeat", heartbeat)
        self._loop_tasks.append(heartbeat)
        if self.disk is not None:
            self._loop_tasks.append(self.loops.spawn("store-node-tasks", self._task_loop()))
        endpoints = {"admin": self.http_url} if self.http_url else {}
        if self.engine.endpoint is not None:
            endpoints["transfer"] = "tcp://{}:{}".format(*self.engine.endpoint)
        meta = {"segment": s.segment_name, "size": s.segment_size, "disk_capacity": s.disk_capacity}
        self._registration = Registration(
            registry, ServiceRecord(self.kind, s.instance_id, endpoints, meta), s.registry_ttl_s
        )
        await self._registration.start()
        log.info(
            "store node %s: segment %s of %d bytes, endpoints %s",
            s.instance_id,
            s.segment_name,
            s.segment_size,
            endpoints,
        )

    async def _task_loop(self) -> None:
        assert self.master is not None and self.disk is not None
        while True:
            try:
                reply = await self.master.call(
                    p.FetchTasks(self.settings.instance_id, TASK_POLL_S), TASK_POLL_S + 5
                )
            except UNREACHABLE:
                await asyncio.sleep(self.settings.heartbeat_interval_s)
                continue
            results: list[p.TaskResult] = []
            for task in reply.tasks:
                results.append(p.TaskResult(task.task_id, await self._run_task(task)))
            if results:
                try:
                    await self.master.call(p.TasksDone(self.settings.instance_id, results))
                except UNREACHABLE as exc:
                    log.warning("could not report %d disk-tier results: %s", len(results), exc)

    async def _run_task(self, task: p.DiskTask) -> str | None:
        assert self.disk is not None and self.region is not None
        try:
            task_id, op, segment, key, offset, length = task
            if segment != self.settings.segment_name:
                raise ValueError(
                    f"task for segment {segment!r}, this node serves {self.settings.segment_name!r}"
                )
            if op != "drop" and offset is None:
                raise ValueError(f"{op} task without a region offset")
            if op == "offload":
                await asyncio.to_thread(self.disk.offload, self.region, key, offset or 0, length)
            elif op == "promote":
                await asyncio.to_thread(self.disk.promote, self.region, key, offset or 0, length)
            elif op == "drop":
                await asyncio.to_thread(self.disk.drop, key)
            else:
                raise ValueError(f"unknown disk-tier op {op!r}")
            self.tasks_done[op] += 1
            return None
        except (OSError, ValueError, TypeError) as exc:
            self.tasks_done["failed"] += 1
            log.warning("disk-tier task %r failed: %s", task, exc)
            return f"{type(exc).__name__}: {exc}"

    @property
    def mounted(self) -> bool:
        return self.mount is not None and self.mount.mounted

    async def shutdown(self) -> None:
        try:
            await cancel_and_wait(self._loop_tasks, "store node")
            if self._registration is not None:
                await self._registration.close()  # logs a Redis that is gone
            if self.mount is not None:
                await self.mount.close(unmount=True)  # its objects leave the pool; logs a gone master
            if self.master is not None:
                await self.master.close()
        finally:
            try:
                if self.engine is not None:
                    await self.engine.close()  # unlinks the region, whatever happened above
            finally:
                if self._redis is not None:
                    await self._redis.aclose()

    def is_ready(self) -> bool:
        return self.mounted

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "instance_id": self.settings.instance_id, **self.describe()}

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {
            "segment": s.segment_name,
            "region": REGION_NAME,
            "size": s.segment_size,
            "incarnation": None if self.engine is None else self.incarnation,
            "transfer": None
            if self.engine is None or self.engine.endpoint is None
            else list(self.engine.endpoint),
            "transports": list(s.transports),
            "tcp_congestion": congestion_flag(s.tcp_congestion),
            "mounted": self.mounted,
            "master": None if self.master is None else self.master.endpoint,
            "disk_dir": s.disk_dir,
            "disk_capacity": s.disk_capacity,
            "disk_tasks": dict(self.tasks_done),
        }

    def admin_router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/segments")
        async def segments() -> list[dict[str, Any]]:
            return [self.describe()]

        @router.get("/stats")
        async def stats() -> dict[str, Any]:
            out = self.describe()
            if self.disk is not None:
                out["disk_used"] = await asyncio.to_thread(self.disk.used_bytes)
            return out

        return router
