"""Async ZeroMQ plumbing: one socket wrapper for every channel, and request/reply RPC on it.

Every channel rides an :class:`Endpoint`: a plain (non-blocking) ROUTER or DEALER socket driven
from the event loop by :class:`~yutu.pump.Pump`, a reader callback on the socket's notification descriptor
that drains every waiting message, so a message costs no future and no task. Sends never block:
they return a :class:`Sent` outcome, and a ROUTER reports a peer it cannot route to
(``ROUTER_MANDATORY``) to the caller instead of dropping the message silently. Nothing here blocks
the event loop; bulk bytes never ride here (they go through :mod:`yutu.transfer`).

Two framings sit on an Endpoint:

- :class:`Peer`, a streaming channel: typed messages of one
  :class:`~yutu.protocol.codec.Channel`, one handler per message type. A channel is added by
  declaring its messages and handlers::

      peer = Peer.router(CHANNEL, {GenerateRequest: admit, Ping: answer}, host, port)
      peer.send(TokenDelta(...), to=identity)       # -> Sent.SENT | Sent.UNROUTABLE | ...

  Frames: ``[identity, payload]`` on a ROUTER, ``[payload]`` on a DEALER.

- :class:`RpcServer` / :class:`RpcClient`, request/reply over DEALER (client) -> ROUTER (server)::

      client -> server:  [call_id (8 bytes), payload]
      server -> client:  [call_id, b"K", payload]                 a reply message
                         [call_id, b"E", msgpack([kind, message])] a typed error

A frame that does not decode is logged and dropped (or, to an RPC server, answered as an invalid
request); it never raises into the loop.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.codec import Channel, ProtocolError
from yutu.pump import Pump

log = logging.getLogger(__name__)

_OK = b"K"
_ERR = b"E"

Handler = Callable[[Any], Any]  # RPC: msg -> reply, or an awaitable of the reply
MessageHandler = Callable[[bytes, Any], None]  # streaming: (sender identity, b"" on a DEALER; msg)
OnConnection = Callable[[bool], None]  # a DEALER's TCP connection came up (True) or dropped (False)


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


class Sent(enum.Enum):
    """What became of a send."""

    SENT = "sent"  # queued for the peer
    UNROUTABLE = "unroutable"  # ROUTER: no connected peer has that identity (it went away)
    FULL = "full"  # the send queue is at its high-water mark
    CLOSED = "closed"  # the endpoint was closed


class Endpoint:
    """One ROUTER or DEALER socket of one channel: frames in (``_on_frames``), sends that never block.

    Subclasses define the framing. A ROUTER reports unroutable peers (``ROUTER_MANDATORY``); a
    DEALER built with ``on_connection`` is told when its TCP connection comes up or drops.
    """

    def __init__(self, channel: Channel, kind: int, name: str) -> None:
        if kind not in (zmq.ROUTER, zmq.DEALER):
            raise ValueError(f"an endpoint is a ROUTER or a DEALER, not socket type {kind}")
        self.channel = channel
        self.name = name
        self.endpoint = ""  # bound or connected to
        self.dropped = 0  # frames dropped because they were malformed or undecodable
        self._sock = _plain_socket(kind)
        if kind == zmq.ROUTER:
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH, not a silent drop
        self._pump = Pump(self._sock, self._on_frames, name)
        self._monitor: Pump | None = None
        self._on_connection: OnConnection | None = None
        self._closed = False

    def _bind(self, host: str, port: int) -> None:
        try:
            self.endpoint = bind(self._sock, host, port)
        except zmq.ZMQError as exc:
            self._close_socket()
            raise OSError(f"{self.name}: cannot bind {host}:{port}: {exc}; pick another port") from exc

    def _connect(self, endpoint: str, on_connection: OnConnection | None) -> None:
        if on_connection is not None:
            self._on_connection = on_connection
            events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
            self._monitor = Pump(
                self._sock.get_monitor_socket(events), self._on_event, f"{self.name}-monitor"
            )
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def start(self) -> asyncio.AbstractEventLoop:
        """Start reading on the running loop (again on a new loop); returns that loop."""
        if self._monitor is not None:
            self._monitor.attach()
        return self._pump.attach()

    @property
    def closed(self) -> bool:
        return self._closed

    def _on_frames(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def _drop(self, why: str, *args: Any) -> None:
        self.dropped += 1
        log.warning("%s: dropping " + why, self.name, *args)

    def _decode(self, payload: bytes) -> Any | None:
        """The message in ``payload``, or None (logged, counted) if it is not one of the channel's."""
        try:
            return self.channel.decode(payload)
        except Exception as exc:  # noqa: BLE001 - a bad frame is dropped, never raised into the loop
            self._drop("an undecodable frame: %s", exc)
            return None

    def _send_frames(self, frames: list[bytes]) -> Sent:
        if self._closed:
            return Sent.CLOSED
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return Sent.FULL
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return Sent.UNROUTABLE
        finally:
            self._pump.kick()
        return Sent.SENT

    def _on_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if self._on_connection is not None and event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
            self._on_connection(event == zmq.EVENT_CONNECTED)

    def _close_socket(self, linger_s: float = 0.0) -> None:
        """Close the socket (idempotent); for ``linger_s`` queued messages still go out in the background."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close()
        self._pump.close(linger_s)


class Peer(Endpoint):
    """A streaming channel's socket: typed messages, dispatched to one handler per message type.

    ``handlers[type(msg)](sender, msg)`` runs on the event loop for each message received; the
    sender is the peer's identity on a ROUTER and ``b""`` on a DEALER. A message of a type with no
    handler is logged and dropped, and so is an undecodable frame. A handler that raises is logged
    and the next message is handled (see :class:`Pump`): it must not hold up the socket, so slow
    work goes to a task. The send queue is unbounded: what bounds a stream is the channel's
    liveness (a peer that stops reading is given up on), never a send that blocks or drops.
    """

    def __init__(
        self, channel: Channel, kind: int, handlers: Mapping[type[Any], MessageHandler], name: str | None
    ) -> None:
        unknown = [cls.__name__ for cls in handlers if cls not in channel.messages]
        if unknown:
            raise TypeError(f"{', '.join(unknown)} not message(s) of channel {channel.name}")
        role = "router" if kind == zmq.ROUTER else "dealer"
        super().__init__(channel, kind, name or f"{channel.name}-{role}")
        self._handlers = dict(handlers)
        self._router = kind == zmq.ROUTER
        self._sock.setsockopt(zmq.SNDHWM, 0)

    @classmethod
    def router(
        cls,
        channel: Channel,
        handlers: Mapping[type[Any], MessageHandler],
        host: str = "127.0.0.1",
        port: int = 0,
        name: str | None = None,
    ) -> Peer:
        """A bound ROUTER, reading on the running loop; many peers connect to it."""
        peer = cls(channel, zmq.ROUTER, handlers, name)
        peer._bind(host, port)
        peer.start()
        return peer

    @classmethod
    def dealer(
        cls,
        channel: Channel,
        handlers: Mapping[type[Any], MessageHandler],
        endpoint: str,
        on_connection: OnConnection | None = None,
        name: str | None = None,
    ) -> Peer:
        """A DEALER connected to ``endpoint``, reading on the running loop.

        Messages sent before the connection is up are queued and go out once it is.
        """
        peer = cls(channel, zmq.DEALER, handlers, name)
        peer._connect(endpoint, on_connection)
        peer.start()
        return peer

    def send(self, msg: Any, to: bytes = b"") -> Sent:
        """Queue ``msg`` (for peer ``to`` on a ROUTER); never blocks. Raises TypeError for a foreign message."""
        payload = self.channel.encode(msg)
        return self._send_frames([to, payload] if self._router else [payload])

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != (2 if self._router else 1):
            self._drop("a frame with %d parts", len(frames))
            return
        msg = self._decode(frames[-1])
        if msg is None:
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._drop("an unexpected %s", type(msg).__name__)
            return
        handler(frames[0] if self._router else b"", msg)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket (idempotent); for ``linger_s`` queued messages still go out."""
        self._close_socket(linger_s)


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
            reply = self._handler(self.channel.decode(payload))
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
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
        future = self._pending.get(call_id)
        if future is None or future.done():
            return  # the caller gave up (timeout) before the answer came
        if status == _OK:
            try:
                future.set_result(self.channel.decode(payload))
            except ProtocolError as exc:
                future.set_exception(YutuError(str(exc), ErrorKind.INTERNAL))
            return
        try:
            kind, message = msgpack.unpackb(payload, raw=False)
            error = YutuError(str(message), ErrorKind(kind))
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            error = YutuError(f"{self.channel.name}: malformed error reply: {exc}", ErrorKind.INTERNAL)
        future.set_exception(error)

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
