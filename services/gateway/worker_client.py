"""The gateway's generate-channel connection to one worker, and the requests running on it.

A :class:`WorkerClient` is a :class:`~yutu.rpc.StreamPeer` dealer (plain TCP) connected to the
worker's router: replies are routed to the waiting request by id on the event loop, every send is
non-blocking (so a sync caller, e.g. a ``finally`` under cancellation, can still abort a request),
and a dropped TCP connection is noticed at once. Liveness: any message from the worker counts
as a sign of life in the pool's :class:`~yutu.liveness.Liveness`; :meth:`WorkerClient.ping` is
called by the pool every interval, and :meth:`WorkerClient.stopped_answering` when the worker has
been silent past the window (frozen: its TCP connection stays up).

A request is a :class:`GenerationHandle`: ``await handle.next()`` returns the worker's next
:class:`TokenDelta` or raises :class:`YutuError`; ``handle.close()`` (sync, idempotent) aborts it on
the worker unless it already finished; ``handle.kv_ready()`` ends the wait of a request sent with
``await_kv``. Whoever submits a request must close its handle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, TypeAlias

from yutu.errors import ErrorKind, YutuError
from yutu.liveness import Liveness
from yutu.protocol.generate import (
    CHANNEL,
    AbortRequest,
    GenerateRequest,
    KVReady,
    Ping,
    Pong,
    RequestFailed,
    TokenDelta,
    TokenDeltas,
)
from yutu.registry import ServiceRecord
from yutu.rpc import Sent, StreamPeer

log = logging.getLogger(__name__)


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
    broken: str | None  # why its engine cannot serve, as the worker's meta says; None: it can
    kv_salt: str | None = None  # what its block keys are salted with (model and dtype); None: not said

    @classmethod
    def from_record(cls, record: ServiceRecord) -> WorkerInfo:
        """Raises KeyError, TypeError or ValueError for a record that does not describe a worker."""
        meta = record.meta
        max_model_len = meta["max_model_len"]
        block_size = meta.get("block_size", 16)
        for name, value in (("max_model_len", max_model_len), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"meta {name} must be a positive int, got {value!r}")
        broken = meta.get("broken")
        return cls(
            instance_id=record.instance_id,
            generate_endpoint=record.endpoints["generate"],
            admin_endpoint=record.endpoints.get("admin"),
            model=str(meta.get("model", "")),
            max_model_len=max_model_len,
            block_size=block_size,
            demo=bool(meta.get("demo", False)),
            broken=None if broken is None or broken is False else str(broken) or "broken",
            kv_salt=None if meta.get("kv_salt") is None else str(meta["kv_salt"]),
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

    def kv_ready(self, token: int, kv: list[Any]) -> None:
        """A request sent with ``await_kv``: its prefill ended with ``token``, its KV held as ``kv``.
        A worker that cannot be told fails the request here (UNAVAILABLE, as a lost worker does)."""
        sent = self.worker._peer.send(KVReady(self.request_id, token, kv))
        if sent is not Sent.SENT:
            self._deliver(
                YutuError(
                    f"cannot reach worker {self.worker.info.instance_id} ({sent.value})",
                    ErrorKind.UNAVAILABLE,
                )
            )

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

    def __init__(self, info: WorkerInfo, liveness: Liveness[str]) -> None:
        self.info = info
        self.connected = False  # TCP connection up
        self.lost = False  # the connection dropped and has not come back
        self.unlisted_since: float | None = None  # monotonic time the registry stopped listing it
        self._requests: dict[str, GenerationHandle] = {}
        self._liveness = liveness
        self._pings = itertools.count()
        liveness.watch(info.instance_id)
        self._peer = StreamPeer.dealer(
            CHANNEL,
            {
                TokenDelta: self._on_reply,
                TokenDeltas: self._on_deltas,
                RequestFailed: self._on_reply,
                Pong: self._on_pong,
            },  # fmt: skip
            info.generate_endpoint,
            on_connection=self._on_connection,
            name=f"generate-{info.instance_id}",
        )
        self.ping()  # queued until connected: the first answer makes the worker live

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def silent(self) -> bool:
        """Nothing came from the worker for longer than the liveness window."""
        return self._liveness.is_silent(self.info.instance_id)

    @property
    def answered(self) -> bool:
        """The worker answered since it joined, and is not silent now."""
        return self._liveness.has_answered(self.info.instance_id)

    @property
    def usable(self) -> bool:
        """May be given new requests: connected or still connecting, answering, not broken."""
        return not self.lost and not self.silent and self.info.broken is None

    @property
    def live(self) -> bool:
        """Usable and known to answer: what makes the gateway ready."""
        return self.usable and self.answered

    def submit(self, request: GenerateRequest) -> GenerationHandle:
        """Send ``request`` to the worker; its replies arrive on the returned handle."""
        if request.request_id in self._requests:
            raise RuntimeError(f"request id {request.request_id} is already in flight")
        sent = self._peer.send(request)
        if sent is not Sent.SENT:
            raise YutuError(
                f"cannot send to worker {self.info.instance_id} ({sent.value}): retry the request",
                ErrorKind.UNAVAILABLE,
            )
        handle = GenerationHandle(self, request.request_id)
        self._requests[request.request_id] = handle
        return handle

    def ping(self) -> None:
        """Send a heartbeat carrying the liveness window (the worker gives up on us past it)."""
        self._peer.send(Ping(next(self._pings), self._liveness.timeout_s))

    def _abort(self, request_id: str) -> None:
        self._peer.send(AbortRequest(request_id))  # a closed or gone worker cannot hear it anyway

    def _release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def fail_all(self, message: str) -> None:
        """Fail every in-flight request (the worker is gone); their handles raise UNAVAILABLE."""
        requests, self._requests = self._requests, {}
        for handle in requests.values():
            handle._deliver(YutuError(message, ErrorKind.UNAVAILABLE))

    def stopped_answering(self, silence_s: float) -> None:
        """The worker was silent for ``silence_s``: fail its requests (and abort them, for when it wakes)."""
        log.warning(
            "worker %s stopped answering for %.1f s: no new requests until it answers again; failing %d",
            self.info.instance_id,
            silence_s,
            self.in_flight,
        )
        request_ids = list(self._requests)
        self.fail_all(
            f"worker {self.info.instance_id} stopped answering for {silence_s:.1f} s: retry the request"
        )
        for request_id in request_ids:
            self._abort(request_id)

    def _heard(self) -> None:
        if self._liveness.heard(self.info.instance_id):
            log.warning("worker %s answers again: back in rotation", self.info.instance_id)

    def _on_reply(self, _: bytes, msg: TokenDelta | RequestFailed) -> None:
        self._heard()
        handle = self._requests.get(msg.request_id)
        if handle is not None:  # else: closed meanwhile (aborted), or failed as silent: drop it
            handle._deliver(msg)

    def _on_deltas(self, identity: bytes, msg: TokenDeltas) -> None:
        for delta in msg.unpack():
            self._on_reply(identity, delta)

    def _on_pong(self, _: bytes, msg: Pong) -> None:
        self._heard()

    def _on_connection(self, up: bool) -> None:
        self.connected = up
        if up:
            self.lost = False
            return
        self.lost = True
        log.warning("lost the connection to worker %s", self.info.instance_id)
        self.fail_all(f"worker {self.info.instance_id} disconnected while generating: retry the request")

    def info_dict(self) -> dict[str, Any]:
        """The worker as the gateway's /info shows it."""
        return {
            "instance_id": self.info.instance_id,
            "endpoint": self.info.generate_endpoint,
            "connected": self.connected,
            "usable": self.usable,
            "live": self.live,
            "silent": self.silent,
            "broken": self.info.broken,
            "in_flight": self.in_flight,
            "max_model_len": self.info.max_model_len,
        }

    async def close(self, linger_s: float = 0.5) -> None:
        """Abort what is in flight (best effort: a gone worker cannot hear it), then close the socket.

        The aborts still go out for up to ``linger_s`` after the socket is closed.
        """
        for request_id in list(self._requests):
            self._abort(request_id)
        self.fail_all(f"worker {self.info.instance_id} left the pool: retry the request")
        self._liveness.forget(self.info.instance_id)
        self._peer.close(linger_s)
