"""The gateway's view of the workers serving its model, and the generate-channel client to each.

One :class:`WorkerClient` per worker: a DEALER connected to the worker's ROUTER, a reader task that
routes replies to the waiting request by id, a writer task that owns every send (so a sync caller,
e.g. a ``finally`` under cancellation, can still abort a request), and a socket monitor that notices a
dropped TCP connection at once. :class:`WorkerPool` re-reads the registry every ``poll_s`` seconds,
connects to new workers, drops vanished ones and fails their in-flight requests, and picks a worker
for each new request (:meth:`WorkerPool.pick`: fewest in-flight requests from this gateway).

A request is a :class:`GenerationHandle`: ``await handle.next()`` returns the worker's next
:class:`TokenDelta` or raises :class:`YutuError`; ``handle.close()`` (sync, idempotent) aborts it on
the worker unless it already finished. Whoever submits a request must close its handle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, TypeAlias

import zmq
import zmq.asyncio
from redis.exceptions import RedisError
from yutu.errors import ErrorKind, YutuError
from yutu.protocol.codec import ProtocolError
from yutu.protocol.generate import CHANNEL, AbortRequest, GenerateRequest, RequestFailed, TokenDelta
from yutu.registry import Registry, ServiceRecord
from yutu.rpc import context
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

WORKER_KIND = "worker"


@dataclass(frozen=True)
class WorkerInfo:
    """What the registry says about one worker (refreshed on every poll)."""

    instance_id: str
    generate_endpoint: str
    admin_endpoint: str | None
    model: str
    max_model_len: int
    block_size: int
    demo: bool

    @classmethod
    def from_record(cls, record: ServiceRecord) -> WorkerInfo:
        meta = record.meta
        return cls(
            instance_id=record.instance_id,
            generate_endpoint=record.endpoints["generate"],
            admin_endpoint=record.endpoints.get("admin"),
            model=str(meta.get("model", "")),
            max_model_len=int(meta["max_model_len"]),
            block_size=int(meta.get("block_size", 16)),
            demo=bool(meta.get("demo", False)),
        )


_Reply: TypeAlias = TokenDelta | RequestFailed | YutuError


class GenerationHandle:
    """One request on one worker. Not thread-safe; used from the event loop only."""

    def __init__(self, worker: WorkerClient, request_id: str) -> None:
        self.worker = worker
        self.request_id = request_id
        self.finished = False  # the worker sent the last delta (or failed the request)
        self.closed = False
        self._replies: asyncio.Queue[_Reply] = asyncio.Queue()

    def _deliver(self, reply: _Reply) -> None:
        self._replies.put_nowait(reply)

    async def next(self) -> TokenDelta:
        """The next delta; raises YutuError if the worker failed the request or went away."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id} already finished")
        reply = await self._replies.get()
        if isinstance(reply, TokenDelta):
            if reply.finish_reason is not None:
                self.finished = True
                self.worker._release(self.request_id)
            return reply
        self.finished = True
        self.worker._release(self.request_id)
        if isinstance(reply, RequestFailed):
            try:
                kind = ErrorKind(reply.kind)
            except ValueError:
                kind = ErrorKind.INTERNAL
            raise YutuError(reply.message, kind)
        raise reply

    def close(self) -> None:
        """Abort the request on the worker unless it finished; safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.worker._release(self.request_id)
            self.worker._abort(self.request_id)


class WorkerClient:
    """The generate-channel connection to one worker, shared by all requests sent to it."""

    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.connected = False  # TCP connection up (from the socket monitor)
        self.lost = False  # the connection dropped and has not come back
        self.unlisted_since: float | None = None  # monotonic time the registry stopped listing it
        self._requests: dict[str, GenerationHandle] = {}
        self._outbox: asyncio.Queue[Any] = asyncio.Queue()
        self._sock = context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(info.generate_endpoint)
        self._tasks = [
            asyncio.create_task(self._read(), name=f"worker-read-{info.instance_id}"),
            asyncio.create_task(self._write(), name=f"worker-write-{info.instance_id}"),
            asyncio.create_task(self._watch(), name=f"worker-monitor-{info.instance_id}"),
        ]

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def usable(self) -> bool:
        return not self.lost

    def submit(self, request: GenerateRequest) -> GenerationHandle:
        """Queue ``request`` for the worker; its replies arrive on the returned handle."""
        if request.request_id in self._requests:
            raise RuntimeError(f"request id {request.request_id} is already in flight")
        handle = GenerationHandle(self, request.request_id)
        self._requests[request.request_id] = handle
        self._outbox.put_nowait(request)
        return handle

    def _abort(self, request_id: str) -> None:
        self._outbox.put_nowait(AbortRequest(request_id))

    def _release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def fail_all(self, message: str) -> None:
        """Fail every in-flight request (the worker is gone); their handles raise UNAVAILABLE."""
        requests, self._requests = self._requests, {}
        for handle in requests.values():
            handle._deliver(YutuError(message, ErrorKind.UNAVAILABLE))

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 1:
                log.warning("dropping generate reply with %d parts", len(frames))
                continue
            try:
                msg = CHANNEL.decode(frames[0])
            except ProtocolError as exc:
                log.warning("dropping undecodable reply from %s: %s", self.info.instance_id, exc)
                continue
            if not isinstance(msg, TokenDelta | RequestFailed):
                log.warning("unexpected %s from worker %s", type(msg).__name__, self.info.instance_id)
                continue
            handle = self._requests.get(msg.request_id)
            if handle is not None:  # else: closed meanwhile (aborted), drop late deltas
                handle._deliver(msg)

    async def _write(self) -> None:
        while True:
            msg = await self._outbox.get()
            try:
                await self._sock.send_multipart([CHANNEL.encode(msg)])
            finally:
                self._outbox.task_done()

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected, self.lost = True, False
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected, self.lost = False, True
                log.warning("lost the connection to worker %s", self.info.instance_id)
                self.fail_all(
                    f"worker {self.info.instance_id} disconnected while generating: retry the request"
                )

    async def close(self, flush_timeout_s: float = 0.5) -> None:
        """Abort what is in flight (best effort: a gone worker cannot hear it), then close the sockets."""
        for request_id in list(self._requests):
            self._abort(request_id)
        self.fail_all(f"worker {self.info.instance_id} left the pool: retry the request")
        try:
            await asyncio.wait_for(self._outbox.join(), flush_timeout_s)
        except TimeoutError:
            log.info(
                "could not flush %d message(s) to worker %s", self._outbox.qsize(), self.info.instance_id
            )
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


class WorkerPool:
    """Workers of one model, kept in sync with the registry.

    The registry says who to send *new* requests to; the connection says who is alive. A worker
    whose record disappears (it is draining, or Redis lost its data) keeps its in-flight requests
    and is picked only when no listed worker can serve; it leaves the pool when its connection
    drops, or once it is idle and has stayed unlisted for ``grace_s`` (a registry TTL).
    """

    def __init__(self, registry: Registry, model: str, poll_s: float = 1.0, grace_s: float = 10.0) -> None:
        self.registry = registry
        self.model = model
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.workers: dict[str, WorkerClient] = {}
        self._task: asyncio.Task[None] | None = None
        self._turn = itertools.count()
        self._last_pick: dict[str, int] = {}

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll(), name="worker-pool")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except (RedisError, OSError) as exc:
                log.warning("cannot read the worker registry (keeping the last known workers): %s", exc)

    async def refresh(self) -> None:
        """Re-read the registry: connect new workers, retire unlisted ones, update the others' info."""
        records = await self.registry.list(WORKER_KIND)
        seen: dict[str, WorkerInfo] = {}
        for record in records:
            if record.meta.get("model") != self.model or "generate" not in record.endpoints:
                continue
            try:
                seen[record.instance_id] = WorkerInfo.from_record(record)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring malformed worker record %s: %s", record.instance_id, exc)
        now = time.monotonic()
        for instance_id, worker in list(self.workers.items()):
            if instance_id in seen:
                continue
            if worker.unlisted_since is None:
                worker.unlisted_since = now
                log.info(
                    "worker %s is no longer listed: no new requests unless no other worker can serve",
                    instance_id,
                )
            if worker.lost or (worker.in_flight == 0 and now - worker.unlisted_since > self.grace_s):
                log.info("worker %s left", instance_id)
                await self.workers.pop(instance_id).close()
        for instance_id, info in seen.items():
            current = self.workers.get(instance_id)
            if current is not None and current.info.generate_endpoint != info.generate_endpoint:
                await self.workers.pop(instance_id).close()  # restarted on another port
                current = None
            if current is None:
                log.info("worker %s joined at %s", instance_id, info.generate_endpoint)
                self.workers[instance_id] = WorkerClient(info)
            else:
                current.info = info
                current.unlisted_since = None

    def usable(self) -> list[WorkerClient]:
        return [w for w in self.workers.values() if w.usable]

    def pick(self) -> WorkerClient:
        """The usable worker with the fewest in-flight requests (ties: the least recently picked).

        Listed workers come before unlisted ones, and workers whose connection is up before ones still connecting (a registered worker whose
        process is gone never connects; its record expires within the registry TTL).
        """
        candidates = self.usable()
        if not candidates:
            raise YutuError(
                f"no worker serving model {self.model!r} is available: start one with "
                f"`yutu worker --served-model-name {self.model}` (same --redis-url and --registry-prefix)",
                ErrorKind.UNAVAILABLE,
            )
        best = min(
            candidates,
            key=lambda w: (
                w.unlisted_since is not None,
                not w.connected,
                w.in_flight,
                self._last_pick.get(w.info.instance_id, -1),
                w.info.instance_id,
            ),
        )
        self._last_pick[best.info.instance_id] = next(self._turn)
        return best

    @property
    def max_model_len(self) -> int | None:
        """The smallest context length among usable workers (None: no worker)."""
        lens = [w.info.max_model_len for w in self.usable()]
        return min(lens) if lens else None

    @property
    def demo(self) -> bool:
        return any(w.info.demo for w in self.workers.values())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for worker in self.workers.values():
            await worker.close()
        self.workers.clear()
