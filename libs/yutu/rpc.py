"""Async ZeroMQ plumbing: endpoints, request/reply RPC and streaming sockets.

Request/reply frames over DEALER (client) -> ROUTER (server)::

    client -> server:  [call_id (8 bytes), payload]
    server -> client:  [call_id, b"K", payload]                 a reply message
                       [call_id, b"E", msgpack([kind, message])] a typed error

Both ends drive plain (non-blocking) ZeroMQ sockets from the event loop: a reader callback on the
socket's notification descriptor drains every waiting message, so a call costs no future per
receive and no task per request. A handler may return its reply directly (answered at once, on the
fast path) or an awaitable of it (awaited in its own task, so a slow call never holds up the
socket). Nothing in this module blocks the event loop. Payloads are control messages of a
:class:`~yutu.protocol.codec.Channel`; bulk bytes never ride here (they go through
:mod:`yutu.transfer`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.codec import Channel, ProtocolError

log = logging.getLogger(__name__)

_OK = b"K"
_ERR = b"E"
_DRAIN_BATCH = 64  # messages handled per reader callback before yielding to other callbacks

Handler = Callable[[Any], Any]  # msg -> reply, or an awaitable of the reply


def context() -> zmq.asyncio.Context:
    """The process-wide asyncio ZeroMQ context."""
    return zmq.asyncio.Context.instance()


def bind(sock: zmq.Socket[Any], host: str, port: int) -> str:
    """Bind ``sock`` on ``host:port`` (port 0: any free port) and return the endpoint bound."""
    if port == 0:
        sock.bind(f"tcp://{host}:*")
    else:
        sock.bind(f"tcp://{host}:{port}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


def _plain_socket(kind: int) -> zmq.Socket[Any]:
    """A non-asyncio socket sharing the I/O threads of :func:`context`."""
    sock: zmq.Socket[Any] = zmq.Context.shadow(context().underlying).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class _Pump:
    """Drains a plain ZeroMQ socket from the event loop.

    ZeroMQ's descriptor is edge-triggered: it signals when the socket's events *change*, and any
    send or receive may consume the change. So the reader drains until EAGAIN, and every send is
    followed by :meth:`kick`, which schedules a drain if a message is already waiting.
    """

    def __init__(self, sock: zmq.Socket[Any], on_frames: Callable[[list[bytes]], None], name: str) -> None:
        self.sock = sock
        self.name = name
        self._on_frames = on_frames
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._closed = False

    def attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self.sock.FD)
            self._loop = loop
            loop.add_reader(self.sock.FD, self._drain)
            self.kick()
        return loop

    def kick(self) -> None:
        if self._scheduled or self._closed or self._loop is None:
            return
        if int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock = self.sock
        for _ in range(_DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_frames(frames)
            except Exception:  # noqa: BLE001 - one bad message must not stop the socket
                log.exception("%s: handling a message failed", self.name)
        self.kick()  # more may be waiting: let other callbacks run first

    def close(self) -> None:
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.FD)
        self.sock.close(linger=0)


class RpcServer:
    """Serves one channel on a ROUTER socket; ``handler(msg)`` returns the reply message.

    The handler may be a plain function (the reply is sent before the next message is read) or
    return an awaitable (a coroutine function, or a fast/slow split), which then runs as a task. A
    handler signals a user-facing failure by raising :class:`YutuError`; any other exception is
    logged and returned as an internal error, and the server keeps serving.
    """

    def __init__(self, channel: Channel, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.channel = channel
        self._handler = handler
        self._sock = _plain_socket(zmq.ROUTER)
        self.endpoint = bind(self._sock, host, port)
        self._pump = _Pump(self._sock, self._on_request, f"rpc-{channel.name}")
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._pump.attach()

    def _on_request(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("dropping malformed %s frame with %d parts", self.channel.name, len(frames))
            return
        identity, call_id, payload = frames
        try:
            reply = self._handler(self.channel.decode(payload))
        except Exception as exc:  # noqa: BLE001 - answered as an error, see _error_frame
            self._send([identity, call_id, *self._error_frames(exc)])
            return
        if inspect.isawaitable(reply):
            task = asyncio.ensure_future(self._answer_later(identity, call_id, reply))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._reply(identity, call_id, reply)

    async def _answer_later(self, identity: bytes, call_id: bytes, pending: Any) -> None:
        try:
            reply = await pending
        except Exception as exc:  # noqa: BLE001 - answered as an error
            self._send([identity, call_id, *self._error_frames(exc)])
            return
        self._reply(identity, call_id, reply)

    def _reply(self, identity: bytes, call_id: bytes, reply: Any) -> None:
        try:
            frames = [identity, call_id, _OK, self.channel.encode(reply)]
        except Exception as exc:  # noqa: BLE001 - a reply the channel cannot carry is a handler bug
            frames = [identity, call_id, *self._error_frames(exc)]
        self._send(frames)

    def _error_frames(self, exc: Exception) -> list[bytes]:
        if isinstance(exc, ProtocolError):
            return [_ERR, _pack_error(ErrorKind.INVALID_REQUEST, str(exc))]
        if isinstance(exc, YutuError):
            return [_ERR, _pack_error(exc.kind, str(exc))]
        log.error("%s handler failed", self.channel.name, exc_info=exc)
        return [_ERR, _pack_error(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")]

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)  # ROUTER never blocks: drops if unroutable
        except zmq.ZMQError as exc:
            log.warning("%s: reply not sent: %s", self.channel.name, exc)
        self._pump.kick()

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pump.close()


class RpcClient:
    """Calls an :class:`RpcServer`; many calls may be in flight at once on one socket."""

    def __init__(self, channel: Channel, endpoint: str, timeout_s: float = 10.0) -> None:
        self.channel = channel
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._sock = _plain_socket(zmq.DEALER)
        self._sock.connect(endpoint)
        self._pump = _Pump(self._sock, self._on_reply, f"rpc-client-{channel.name}")
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future[Any]] = {}
        self._closed = False

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        """Send ``msg`` and return the reply; raises :class:`YutuError` on error or timeout."""
        if self._closed:
            raise YutuError(f"{self.channel.name} client to {self.endpoint} is closed", ErrorKind.UNAVAILABLE)
        loop = self._pump.attach()
        call_id = next(self._ids).to_bytes(8, "little")
        payload = self.channel.encode(msg)
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[call_id] = future
        timeout = self.timeout_s if timeout_s is None else timeout_s
        timer = loop.call_later(timeout, _expire, future)
        try:
            await self._send([call_id, payload], loop.time() + timeout)
            return await future
        except TimeoutError:
            raise YutuError(
                f"{self.channel.name} call {type(msg).__name__} to {self.endpoint} got no answer in time:"
                " is the server running?",
                ErrorKind.UNAVAILABLE,
            ) from None
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)

    async def _send(self, frames: list[bytes], deadline: float) -> None:
        """Send without blocking; while the send queue is full (high-water mark) retry until ``deadline``."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:
                if loop.time() >= deadline:
                    raise TimeoutError from None
                await asyncio.sleep(0.001)
        self._pump.kick()

    def _on_reply(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("dropping malformed %s reply with %d parts", self.channel.name, len(frames))
            return
        call_id, status, payload = frames
        future = self._pending.get(call_id)
        if future is None or future.done():
            return  # the caller gave up (timeout) before the answer came
        if status == _OK:
            try:
                future.set_result(self.channel.decode(payload))
            except ProtocolError as exc:
                future.set_exception(YutuError(str(exc), ErrorKind.INTERNAL))
        else:
            kind, message = msgpack.unpackb(payload, raw=False)
            future.set_exception(YutuError(message, ErrorKind(kind)))

    async def close(self) -> None:
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(YutuError("client closed", ErrorKind.UNAVAILABLE))
        self._pump.close()


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _pack_error(kind: ErrorKind, message: str) -> bytes:
    return msgpack.packb([kind.value, message], use_bin_type=True)
