"""Request/reply over :mod:`yutu.rpc` endpoints (DEALER client -> ROUTER server)::

client -> server:  [call_id (8 bytes), payload]
server -> client:  [call_id, b"K", payload]                 a reply message
                   [call_id, b"E", msgpack([kind, message])] a typed error
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

from yutu.errors import ErrorKind, YutuError
from yutu.logs import about
from yutu.protocol.codec import Channel, ProtocolError
from yutu.rpc.sockets import Endpoint, OnConnection, Sent
from yutu.supervise import cancel_and_wait

log = logging.getLogger("yutu.rpc")

_OK = b"K"
_ERR = b"E"

Handler = Callable[[Any], Any]  # RPC: msg -> reply, or an awaitable of the reply


class RpcServer(Endpoint):
    """Serves one channel on a ROUTER socket; ``handler(msg)`` returns the reply message.

    The handler may be a plain function (the reply is sent before the next message is read) or
    return an awaitable (a coroutine function, or a fast/slow split), which then runs as a task. A
    handler signals a user-facing failure by raising :class:`YutuError`; any other exception is
    logged and returned as an internal error, and the server keeps serving.
    """

    def __init__(self, channel: Channel, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(channel, zmq.ROUTER, f"rpc-{channel.name}")
        self._handler = handler
        self._bind(host, port)
        self._tasks: set[asyncio.Task[None]] = set()

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._drop("a request with %d parts", len(frames))
            return
        identity, call_id, payload = frames
        try:
            msg = self.channel.decode(payload)
        except Exception as exc:  # noqa: BLE001 - answered as an error, see _error_frames
            self._send([identity, call_id, *self._error_frames(exc)])
            return
        with about(msg):  # the handler's lines and the task answering later name the request
            try:
                reply = self._handler(msg)
            except Exception as exc:  # noqa: BLE001 - answered as an error, see _error_frames
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
        sent = self._send_frames(frames)
        if sent is not Sent.SENT:
            log.warning("%s: reply not sent (%s): the client gave up or is gone", self.name, sent.value)

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks), "RPC server")
        self._close_socket()


class RpcClient(Endpoint):
    """Calls an :class:`RpcServer`; many calls may be in flight at once on one socket.

    ``on_connection(up)`` (optional) is told when the TCP connection comes up or drops; it is
    watched from the first :meth:`call` or :meth:`start` on (both need the running loop).
    """

    def __init__(
        self,
        channel: Channel,
        endpoint: str,
        timeout_s: float = 10.0,
        on_connection: OnConnection | None = None,
    ) -> None:
        super().__init__(channel, zmq.DEALER, f"rpc-client-{channel.name}")
        self.timeout_s = timeout_s
        self._connect(endpoint, on_connection)
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future[Any]] = {}

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        """Send ``msg`` and return the reply; raises :class:`YutuError` on error or timeout."""
        if self.closed:
            raise YutuError(f"{self.channel.name} client to {self.endpoint} is closed", ErrorKind.UNAVAILABLE)
        loop = self.start()
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
            sent = self._send_frames(frames)
            if sent is Sent.SENT:
                return
            if sent is Sent.CLOSED:
                raise YutuError(
                    f"{self.channel.name} client to {self.endpoint} is closed", ErrorKind.UNAVAILABLE
                )
            if loop.time() >= deadline:
                raise TimeoutError
            await asyncio.sleep(0.001)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._drop("a reply with %d parts", len(frames))
            return
        call_id, status, payload = frames
        settle_reply(self._pending.get(call_id), self.channel, status == _OK, payload)

    async def close(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(YutuError("client closed", ErrorKind.UNAVAILABLE))
        self._close_socket()


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _pack_error(kind: ErrorKind, message: str) -> bytes:
    return msgpack.packb([kind.value, message], use_bin_type=True)


def settle_reply(future: asyncio.Future[Any] | None, channel: Channel, ok: bool, payload: bytes) -> None:
    """Resolve a call's ``future`` from its reply: the decoded message when ``ok``, else the error the
    server named (``[kind, message]``, msgpack). Nothing when the caller already gave up (timeout)."""
    if future is None or future.done():
        return
    if ok:
        try:
            future.set_result(channel.decode(payload))
        except ProtocolError as exc:
            future.set_exception(YutuError(str(exc), ErrorKind.INTERNAL))
        return
    try:
        kind, message = msgpack.unpackb(payload, raw=False)
        error = YutuError(str(message), ErrorKind(kind))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        error = YutuError(f"{channel.name}: malformed error reply: {exc}", ErrorKind.INTERNAL)
    future.set_exception(error)
