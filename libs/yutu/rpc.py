"""Async ZeroMQ plumbing: endpoints, request/reply RPC and streaming sockets.

Request/reply frames over DEALER (client) -> ROUTER (server)::

    client -> server:  [call_id (8 bytes), payload]
    server -> client:  [call_id, b"K", payload]                 a reply message
                       [call_id, b"E", msgpack([kind, message])] a typed error

Handlers run as their own tasks, so a slow call never holds up the socket; nothing in this module
blocks the event loop. Payloads are control messages of a :class:`~yutu.protocol.codec.Channel`;
bulk bytes never ride here (they go through :mod:`yutu.transfer`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.codec import Channel, ProtocolError

log = logging.getLogger(__name__)

_OK = b"K"
_ERR = b"E"

Handler = Callable[[Any], Awaitable[Any]]


def context() -> zmq.asyncio.Context:
    """The process-wide asyncio ZeroMQ context."""
    return zmq.asyncio.Context.instance()


def bind(sock: zmq.asyncio.Socket, host: str, port: int) -> str:
    """Bind ``sock`` on ``host:port`` (port 0: any free port) and return the endpoint bound."""
    if port == 0:
        sock.bind(f"tcp://{host}:*")
    else:
        sock.bind(f"tcp://{host}:{port}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


class RpcServer:
    """Serves one channel on a ROUTER socket; ``handler(msg)`` returns the reply message.

    A handler signals a user-facing failure by raising :class:`YutuError`; any other exception is
    logged and returned as an internal error, and the server keeps serving.
    """

    def __init__(self, channel: Channel, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.channel = channel
        self._handler = handler
        self._sock = context().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind(self._sock, host, port)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._serve(), name=f"rpc-{self.channel.name}")

    async def _serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            if len(frames) != 3:
                log.warning("dropping malformed %s frame with %d parts", self.channel.name, len(frames))
                continue
            task = asyncio.create_task(self._answer(*frames))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, identity: bytes, call_id: bytes, payload: bytes) -> None:
        try:
            reply = await self._handler(self.channel.decode(payload))
            frames = [identity, call_id, _OK, self.channel.encode(reply)]
        except ProtocolError as exc:
            frames = [identity, call_id, _ERR, _pack_error(ErrorKind.INVALID_REQUEST, str(exc))]
        except YutuError as exc:
            frames = [identity, call_id, _ERR, _pack_error(exc.kind, str(exc))]
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server
            log.exception("%s handler failed", self.channel.name)
            frames = [
                identity,
                call_id,
                _ERR,
                _pack_error(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}"),
            ]
        await self._sock.send_multipart(frames)

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close(linger=0)


class RpcClient:
    """Calls an :class:`RpcServer`; many calls may be in flight at once on one socket."""

    def __init__(self, channel: Channel, endpoint: str, timeout_s: float = 10.0) -> None:
        self.channel = channel
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._sock = context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        """Send ``msg`` and return the reply; raises :class:`YutuError` on error or timeout."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name=f"rpc-client-{self.channel.name}")
        call_id = next(self._ids).to_bytes(8, "little")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            await self._sock.send_multipart([call_id, self.channel.encode(msg)])
            return await asyncio.wait_for(future, timeout_s if timeout_s is not None else self.timeout_s)
        except TimeoutError:
            raise YutuError(
                f"{self.channel.name} call {type(msg).__name__} to {self.endpoint} got no answer in time:"
                " is the server running?",
                ErrorKind.UNAVAILABLE,
            ) from None
        finally:
            self._pending.pop(call_id, None)

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            if len(frames) != 3:
                log.warning("dropping malformed %s reply with %d parts", self.channel.name, len(frames))
                continue
            call_id, status, payload = frames
            future = self._pending.get(call_id)
            if future is None or future.done():
                continue  # the caller gave up (timeout) before the answer came
            if status == _OK:
                try:
                    future.set_result(self.channel.decode(payload))
                except ProtocolError as exc:
                    future.set_exception(YutuError(str(exc), ErrorKind.INTERNAL))
            else:
                kind, message = msgpack.unpackb(payload, raw=False)
                future.set_exception(YutuError(message, ErrorKind(kind)))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(YutuError("client closed", ErrorKind.UNAVAILABLE))
        self._sock.close(linger=0)


def _pack_error(kind: ErrorKind, message: str) -> bytes:
    return msgpack.packb([kind.value, message], use_bin_type=True)
