"""Request/reply over one plain TCP connection per client: the low-latency twin of :mod:`yutu.rpc.reqrep`.

A ZeroMQ round trip crosses four threads (caller -> ZeroMQ I/O thread -> socket -> I/O thread ->
event loop, and back), and on a small, busy host each of those wake-ups costs more than the
message: a bare DEALER/ROUTER round trip measures ~120-180 us here, a plain asyncio TCP
request/response ~25 us. For the hot control channel of the store (a get asks the master once, a
put twice) the master serves both; this one is what clients use when the master advertises it, and
:mod:`yutu.rpc.reqrep` stays the reference (tests check that the two answer alike).

Frames, both directions (little-endian; ``length`` counts the payload only)::

    length u32 | call_id u64 | status u8 | payload
    status b"Q": a request (payload: the channel's message)
           b"K": a reply   (payload: the channel's message)
           b"E": an error  (payload: msgpack([ErrorKind value, message]))

Same contract as :class:`~yutu.rpc.reqrep.RpcServer`: ``handler(msg)`` returns the reply or an
awaitable of it (run as a task); :class:`YutuError` goes back typed, anything else is logged and
answered INTERNAL. Differences from the ZeroMQ pair, on purpose: a call in flight when its
connection drops fails at once with UNAVAILABLE (ZeroMQ would let it time out), a call made
while the server is down retries the connection until its timeout (as ZeroMQ reconnects), and a
reply that cannot be sent because its client's connection is gone goes to the server's
``on_undelivered`` (where what the reply hands over -- a KV hold -- can be given back at once).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, cast

import msgpack

from yutu.busypoll import poll_until
from yutu.errors import BindError, ErrorKind, YutuError
from yutu.logs import about
from yutu.protocol.codec import Channel, ProtocolError
from yutu.rpc.reqrep import RpcClient, settle_reply
from yutu.rpc.sockets import OnConnection
from yutu.supervise import cancel_and_wait

log = logging.getLogger("yutu.rpc")

HEADER = struct.Struct("<IQc")  # payload length, call id, status
MAX_FRAME = 64 << 20  # a longer frame is a broken or hostile peer: the connection is closed
_REQ, _OK, _ERR = b"Q", b"K", b"E"
_RETRY_S = (0.005, 0.02, 0.05, 0.1, 0.25)  # connect retries while the server is not up


class NotConnectedError(YutuError):
    """The call was never sent: no connection to the server could be made (safe to retry elsewhere)."""

    kind = ErrorKind.UNAVAILABLE


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ValueError with the expected form otherwise."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"stream endpoint {endpoint!r} is not of the form tcp://host:port")
    host, port = endpoint[6:].rsplit(":", 1)
    return host, int(port)


def _frame(call_id: int, status: bytes, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), call_id, status) + payload


def _pack_error(kind: ErrorKind, message: str) -> bytes:
    return msgpack.packb([kind.value, message], use_bin_type=True)


class _Framer:
    """Cuts a byte stream into ``(call_id, status, payload)`` frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes, bytes]]:
        """The frames completed by ``data``; raises ProtocolError on an oversized frame."""
        if self._buf:
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        frames, pos, end = [], 0, len(data)
        while end - pos >= HEADER.size:
            length, call_id, status = HEADER.unpack_from(data, pos)
            if length > MAX_FRAME:
                raise ProtocolError(f"a frame of {length} bytes (at most {MAX_FRAME})")
            start = pos + HEADER.size
            if end - start < length:
                break
            frames.append((call_id, status, data[start : start + length]))
            pos = start + length
        if pos < end:
            self._buf += data[pos:]
        return frames


def _no_delay(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """``transport`` with Nagle off (one small frame per call must not wait for more)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass


class _ServerConnection(asyncio.Protocol):
    def __init__(self, server: StreamRpcServer) -> None:
        self._server = server
        self._framer = _Framer()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = _no_delay(transport)
        self._server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._framer.feed(data)
        except ProtocolError as exc:
            log.warning("%s: closing a connection that sent %s", self._server.name, exc)
            self.close()
            return
        for call_id, status, payload in frames:
            if status != _REQ:
                log.warning(
                    "%s: closing a connection that sent a frame of status %r", self._server.name, status
                )
                self.close()
                return
            self._server._on_request(self, call_id, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
        self.transport = None

    def send(self, frame: bytes) -> bool:
        """Write a frame; False (and a warning) when the client's connection is gone."""
        if self.transport is None or self.transport.is_closing():
            log.warning("%s: reply not sent: the client is gone", self._server.name)
            return False
        self.transport.write(frame)
        return True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class StreamRpcServer:
    """Serves one channel on a TCP listener (see the module docstring); :meth:`start` binds."""

    def __init__(self, channel: Channel, handler: Callable[[Any], Any], host: str = "127.0.0.1",
                 port: int = 0, on_undelivered: Callable[[Any], None] | None = None,
                 spin_s: float = 0.0) -> None:  # fmt: skip
        """``spin_s``: while calls come back to back (each within ``spin_s`` of the previous reply),
        keep the event loop awake for up to ``spin_s`` after each reply, so the next call finds it
        polling instead of asleep (``yutu.busypoll``; 0: sleep at once). A server called now and
        then never spins; one called back to back spends at most ``spin_s`` of CPU a call."""
        if spin_s < 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s}")
        self.channel = channel
        self.name = f"rpc-stream-{channel.name}"
        self.endpoint = ""  # tcp://host:port once started
        self.spin_s = spin_s
        self._handler = handler
        self._on_undelivered = on_undelivered  # called with a reply whose client is gone
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._replied_at = float("-inf")  # time.perf_counter() of the last reply
        self._hot = False  # the last call came within spin_s of the reply before it
        self._awake_until = 0.0  # keep the loop polling until this time.perf_counter()
        self._awake = False  # a keep-awake callback is scheduled

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _ServerConnection(self), self._host, self._port)
        except OSError as exc:
            raise BindError(
                f"{self.name}: cannot bind {self._host}:{self._port}: {exc}; pick another port"
            ) from exc
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"tcp://{self._host}:{port}"

    def _on_request(self, conn: _ServerConnection, call_id: int, payload: bytes) -> None:
        if self.spin_s:
            self._hot = time.perf_counter() - self._replied_at <= self.spin_s
        try:
            msg = self.channel.decode(payload)
        except Exception as exc:  # noqa: BLE001 - answered as an error, see _error
            conn.send(self._error(call_id, exc))
            return
        with about(msg):  # the handler's lines and the task answering later name the request
            try:
                reply = self._handler(msg)
            except Exception as exc:  # noqa: BLE001 - answered as an error, see _error
                conn.send(self._error(call_id, exc))
                return
            if inspect.isawaitable(reply):
                task = asyncio.ensure_future(self._answer_later(conn, call_id, reply))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
        self._answer(conn, call_id, reply)

    async def _answer_later(self, conn: _ServerConnection, call_id: int, pending: Any) -> None:
        try:
            reply = await pending
        except Exception as exc:  # noqa: BLE001 - answered as an error
            conn.send(self._error(call_id, exc))
            return
        self._answer(conn, call_id, reply)

    def _answer(self, conn: _ServerConnection, call_id: int, reply: Any) -> None:
        if not conn.send(self._reply(call_id, reply)) and self._on_undelivered is not None:
            self._on_undelivered(reply)
        if self.spin_s:
            self._replied_at = now = time.perf_counter()
            if self._hot:
                self._awake_until = now + self.spin_s
                if not self._awake:
                    self._awake = True
                    asyncio.get_running_loop().call_soon(self._keep_awake)

    def _keep_awake(self) -> None:
        """Polls: a loop with a callback ready checks its sockets without sleeping."""
        if time.perf_counter() < self._awake_until:
            asyncio.get_running_loop().call_soon(self._keep_awake)
        else:
            self._awake = False

    def _reply(self, call_id: int, reply: Any) -> bytes:
        try:
            return _frame(call_id, _OK, self.channel.encode(reply))
        except Exception as exc:  # noqa: BLE001 - a reply the channel cannot carry is a handler bug
            return self._error(call_id, exc)

    def _error(self, call_id: int, exc: Exception) -> bytes:
        if isinstance(exc, ProtocolError):
            payload = _pack_error(ErrorKind.INVALID_REQUEST, str(exc))
        elif isinstance(exc, YutuError):
            payload = _pack_error(exc.kind, str(exc))
        else:
            log.error("%s handler failed", self.channel.name, exc_info=exc)
            payload = _pack_error(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")
        return _frame(call_id, _ERR, payload)

    async def close(self) -> None:
        """Stop listening, cut every connection (their calls in flight fail at the clients)."""
        self._awake_until = 0.0
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        await cancel_and_wait(list(self._tasks), "stream server")
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _ClientConnection(asyncio.Protocol):
    def __init__(self, client: StreamRpcClient) -> None:
        self._client = client
        self._framer = _Framer()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = _no_delay(transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._framer.feed(data)
        except ProtocolError as exc:
            self._client._lost(self, f"it sent {exc}")
            self.close()
            return
        for call_id, status, payload in frames:
            self._client._on_reply(call_id, status, payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._client._lost(self, str(exc) if exc is not None else "closed by the server")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class StreamRpcClient:
    """Calls a :class:`StreamRpcServer`; many calls may be in flight on its one connection.

    Connects on the first call (and again after the connection dropped), retrying while the server
    refuses for up to ``connect_timeout_s`` (None: the call's whole timeout); a call that could not
    connect raises :class:`NotConnectedError`. ``on_connection(up)`` (optional) is told when a
    connection is made and when it drops (not when the client closes it). ``spin_s``: after
    sending, wait for the reply awake for up to this long before sleeping (``yutu.busypoll``; 0:
    sleep at once)."""

    def __init__(
        self,
        channel: Channel,
        endpoint: str,
        timeout_s: float = 10.0,
        connect_timeout_s: float | None = None,
        on_connection: OnConnection | None = None,
        spin_s: float = 0.0,
    ) -> None:
        if spin_s < 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s}")
        self.channel = channel
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self.connect_timeout_s = connect_timeout_s
        self._on_connection = on_connection
        self._host, self._port = parse_endpoint(endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._conn: _ClientConnection | None = None
        self._connecting: asyncio.Future[_ClientConnection] | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        """Send ``msg`` and return the reply; raises :class:`YutuError` on error, timeout or a lost connection."""
        if self._closed:
            raise YutuError(f"{self.channel.name} client to {self.endpoint} is closed", ErrorKind.UNAVAILABLE)
        loop = asyncio.get_running_loop()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        payload = self.channel.encode(msg)
        conn = self._conn
        if conn is None or conn.transport is None:
            wait = timeout if self.connect_timeout_s is None else min(timeout, self.connect_timeout_s)
            conn = await self._connect(loop, loop.time() + wait, msg)
        call_id = next(self._ids)
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[call_id] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            transport = conn.transport
            if transport is None:  # dropped meanwhile: ask again
                raise YutuError(
                    f"{self.channel.name} connection to {self.endpoint} lost; retry", ErrorKind.UNAVAILABLE
                )
            transport.write(_frame(call_id, _REQ, payload))
            await poll_until(future.done, self.spin_s)
            return await future
        except TimeoutError:
            raise self._no_answer(msg) from None
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)

    def _no_answer(self, msg: Any) -> YutuError:
        return YutuError(
            f"{self.channel.name} call {type(msg).__name__} to {self.endpoint} got no answer in time:"
            " is the server running?",
            ErrorKind.UNAVAILABLE,
        )

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float, msg: Any) -> _ClientConnection:
        """The live connection, made (one attempt shared by concurrent callers, retried while the
        server refuses) before ``deadline``."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._dial(loop, deadline))
            # a caller that gave up (its deadline, a cancel) leaves the attempt running: its failure
            # is read here, or asyncio would log it as never retrieved
            self._connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(self._connecting), max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and (task is None or not task.cancelling()):  # close() cut the attempt short
                raise NotConnectedError(
                    f"{self.channel.name} call {type(msg).__name__}: the client to {self.endpoint} was closed"
                    " while connecting"
                ) from None
            raise
        except (TimeoutError, OSError) as exc:
            why = "no connection in time" if isinstance(exc, TimeoutError) else str(exc)
            raise NotConnectedError(
                f"{self.channel.name} call {type(msg).__name__}: cannot connect to {self.endpoint} ({why}):"
                " is the server running?"
            ) from None

    async def _dial(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _ClientConnection:
        try:
            for attempt in itertools.count():
                try:
                    _, conn = await loop.create_connection(
                        lambda: _ClientConnection(self), self._host, self._port
                    )
                except OSError:
                    pause = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                    if self._closed or loop.time() + pause >= deadline:
                        raise
                    await asyncio.sleep(pause)
                    continue
                if self._closed:
                    conn.close()
                    raise OSError("client closed")
                self._conn = conn
                if self._on_connection is not None:
                    self._on_connection(True)
                return conn
            raise AssertionError("unreachable")
        finally:
            self._connecting = None

    def _on_reply(self, call_id: int, status: bytes, payload: bytes) -> None:
        settle_reply(self._pending.get(call_id), self.channel, status == _OK, payload)

    def _lost(self, conn: _ClientConnection, why: str) -> None:
        """The connection dropped: every call in flight on it fails UNAVAILABLE (the next call reconnects)."""
        if self._conn is not conn:
            return  # an older connection: its calls were failed when it was replaced
        self._conn = None
        error = f"{self.channel.name} connection to {self.endpoint} lost ({why}); retry"
        for future in self._pending.values():
            if not future.done():
                future.set_exception(YutuError(error, ErrorKind.UNAVAILABLE))
        if self._on_connection is not None and not self._closed:
            self._on_connection(False)

    async def close(self) -> None:
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(YutuError("client closed", ErrorKind.UNAVAILABLE))
        if self._connecting is not None:
            self._connecting.cancel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def preferred_endpoint(endpoints: dict[str, str], name: str) -> str:
    """A service's endpoint ``name``: its plain TCP stream twin (``{name}_stream``) when it
    advertises one, else the ZeroMQ one."""
    return endpoints.get(f"{name}_stream") or endpoints[name]


def client_for(
    channel: Channel,
    endpoints: dict[str, str],
    name: str,
    timeout_s: float,
    on_connection: OnConnection | None = None,
) -> RpcClient | StreamRpcClient:
    """The client of ``preferred_endpoint(endpoints, name)``: over the stream (no ZeroMQ I/O
    threads on either side) when advertised, else ZeroMQ."""
    if f"{name}_stream" in endpoints:
        return StreamRpcClient(channel, endpoints[f"{name}_stream"], timeout_s, on_connection=on_connection)
    return RpcClient(channel, endpoints[name], timeout_s, on_connection=on_connection)


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
