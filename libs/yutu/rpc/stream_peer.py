"""Streaming channels over plain TCP: the low-latency twin of :class:`yutu.rpc.Peer`.

Same contract as the ZeroMQ :class:`~yutu.rpc.Peer` (typed messages, one handler per message type,
sends that never block and are queued until a dealer's first connection is up, a dealer told when
its connection comes up or drops and reconnecting by itself, a router that reports a gone peer as
:attr:`Sent.UNROUTABLE`), without ZeroMQ's I/O thread: every message is written and read by the
event loop itself. The generate channel (gateway -> worker, a few messages per request and one
per engine step back) is where that pays: each ZeroMQ message wakes an I/O thread on both sides,
and on a small host those wake-ups fight the engine for the cores. ``loadtests/bench_channel.py``
(one TokenDelta a millisecond between two processes, 2 vCPUs): sender CPU 0.68-0.71x, receiver
CPU 0.52x, one-way latency p50 0.58-0.59x (~155-175 -> ~90-100 us) against ZeroMQ.
``Peer`` stays the reference; the tests run the same cases on both.

Frames, both directions: ``length u32 (little-endian) | payload`` (the channel's message). A router
names each accepted connection by a 5-byte identity (as ZeroMQ does); a dealer's messages reach
its handlers with ``b""`` as the sender. Differences from ZeroMQ, on purpose: what a dealer queued
while disconnected goes out once it reconnects (ZeroMQ drops what was queued on a broken pipe),
and a frame longer than ``MAX_FRAME`` closes that connection (a broken or hostile peer).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct
from collections.abc import Mapping
from typing import Any

from yutu.errors import BindError
from yutu.logs import about
from yutu.protocol.codec import Channel
from yutu.rpc.peer import MessageHandler, check_handlers
from yutu.rpc.sockets import OnConnection, Sent
from yutu.rpc.stream import MAX_FRAME, _no_delay, parse_endpoint

log = logging.getLogger("yutu.rpc")

FRAME = struct.Struct("<I")
RECONNECT_S = 0.1  # a dealer retries a refused or dropped connection this often (ZeroMQ's default)


class _Connection(asyncio.Protocol):
    """One TCP connection of a :class:`StreamPeer`: cuts the stream into frames, writes frames."""

    def __init__(self, peer: StreamPeer, identity: bytes) -> None:
        self.peer = peer
        self.identity = identity
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = _no_delay(transport)
        self.peer._connected(self)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while len(buf) - pos >= FRAME.size:
                (length,) = FRAME.unpack_from(buf, pos)
                if length > MAX_FRAME:
                    log.warning(
                        "%s: closing a connection that sent a frame of %d bytes", self.peer.name, length
                    )
                    self.close(0.0)
                    return
                end = pos + FRAME.size + length
                if len(buf) < end:
                    break
                payload = bytes(buf[pos + FRAME.size : end])
                pos = end
                self.peer._on_payload(self.identity, payload)
        finally:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        self.peer._disconnected(self)

    def write(self, payload: bytes) -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(FRAME.pack(len(payload)) + payload)
        return True

    def close(self, linger_s: float) -> None:
        """Close after what is buffered went out, or cut it after ``linger_s``."""
        transport = self.transport
        if transport is None:
            return
        transport.close()  # flushes the write buffer first
        if linger_s > 0:
            asyncio.get_running_loop().call_later(linger_s, transport.abort)
        else:
            transport.abort()


class StreamPeer:
    """A streaming channel's endpoint over plain TCP; see the module docstring.

    ``handlers[type(msg)](sender, msg)`` runs on the event loop for each message received. A
    message of a type with no handler is logged and dropped, and so is an undecodable frame
    (counted in :attr:`dropped`). A handler that raises is logged and the next message is handled.
    """

    def __init__(self, channel: Channel, handlers: Mapping[type[Any], MessageHandler], name: str,
                 router: bool) -> None:  # fmt: skip
        check_handlers(channel, handlers)
        self.channel = channel
        self.name = name
        self.endpoint = ""  # bound (router) or connected to (dealer)
        self.dropped = 0
        self._handlers = dict(handlers)
        self._router = router
        self._connections: dict[bytes, _Connection] = {}  # a dealer's one connection is b""
        self._identities = itertools.count(1)
        self._queued: list[bytes] = []  # a dealer's payloads sent while it was not connected
        self._on_connection: OnConnection | None = None
        self._task: asyncio.Task[Any] | None = None
        self._server: asyncio.Server | None = None
        self._closed = False

    @classmethod
    def router(
        cls,
        channel: Channel,
        handlers: Mapping[type[Any], MessageHandler],
        host: str = "127.0.0.1",
        port: int = 0,
        name: str | None = None,
    ) -> StreamPeer:
        """Bound on ``host:port`` (0: any free port) and serving on the running loop."""
        peer = cls(channel, handlers, name or f"{channel.name}-router", router=True)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise BindError(
                f"{peer.name}: cannot bind {host}:{port}: {exc.strerror}; pick another port"
            ) from exc
        sock.listen(512)
        sock.setblocking(False)
        shown = f"[{host}]" if ":" in host else host
        peer.endpoint = f"tcp://{shown}:{sock.getsockname()[1]}"
        peer._task = asyncio.create_task(peer._serve(sock), name=f"{peer.name}-accept")
        return peer

    @classmethod
    def dealer(
        cls,
        channel: Channel,
        handlers: Mapping[type[Any], MessageHandler],
        endpoint: str,
        on_connection: OnConnection | None = None,
        name: str | None = None,
    ) -> StreamPeer:
        """Connecting to ``endpoint`` (and reconnecting whenever the connection drops)."""
        host, port = parse_endpoint(endpoint)
        peer = cls(channel, handlers, name or f"{channel.name}-dealer", router=False)
        peer.endpoint = endpoint
        peer._on_connection = on_connection
        peer._task = asyncio.create_task(
            peer._keep_connected(host.strip("[]"), port), name=f"{peer.name}-connect"
        )
        return peer

    @property
    def closed(self) -> bool:
        return self._closed

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self, b"\x00" + next(self._identities).to_bytes(4, "big")), sock=sock
            )
        except BaseException:
            sock.close()  # closed before it served
            raise
        if self._closed:
            self._server.close()

    async def _keep_connected(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                _, conn = await loop.create_connection(lambda: _Connection(self, b""), host, port)
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            await conn.lost
            await asyncio.sleep(RECONNECT_S)

    # -- connections -----------------------------------------------------------------------------

    def _connected(self, conn: _Connection) -> None:
        if self._closed:
            conn.close(0.0)
            return
        self._connections[conn.identity] = conn
        if self._router:
            return
        queued, self._queued = self._queued, []
        for payload in queued:
            conn.write(payload)
        if self._on_connection is not None:
            self._on_connection(True)

    def _disconnected(self, conn: _Connection) -> None:
        if self._connections.get(conn.identity) is not conn:
            return
        del self._connections[conn.identity]
        if not self._router and not self._closed and self._on_connection is not None:
            self._on_connection(False)

    # -- messages --------------------------------------------------------------------------------

    def send(self, msg: Any, to: bytes = b"") -> Sent:
        """Send ``msg`` (to peer ``to`` on a router); never blocks. Raises TypeError for a foreign message."""
        payload = self.channel.encode(msg)
        if self._closed:
            return Sent.CLOSED
        conn = self._connections.get(to if self._router else b"")
        if conn is not None and conn.write(payload):
            return Sent.SENT
        if self._router:
            return Sent.UNROUTABLE
        self._queued.append(payload)  # goes out once connected
        return Sent.SENT

    def _on_payload(self, sender: bytes, payload: bytes) -> None:
        try:
            msg = self.channel.decode(payload)
        except Exception as exc:  # noqa: BLE001 - a bad frame is dropped, never raised into the loop
            self._drop("an undecodable frame: %s", exc)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._drop("an unexpected %s", type(msg).__name__)
            return
        with about(msg):
            try:
                handler(sender, msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the connection
                log.exception("%s: handling a message failed", self.name)

    def _drop(self, why: str, *args: Any) -> None:
        self.dropped += 1
        log.warning("%s: dropping " + why, self.name, *args)

    def close(self, linger_s: float = 0.0) -> None:
        """Stop (idempotent); for ``linger_s`` what was already sent still goes out."""
        if self._closed:
            return
        self._closed = True
        self._queued.clear()
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections.values()):
            conn.close(linger_s)
        self._connections.clear()
