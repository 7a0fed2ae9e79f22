"""The socket layer of :mod:`yutu.rpc`: the process-wide context, binding, and :class:`Endpoint`,
one plain (non-blocking) ROUTER or DEALER socket driven by :class:`~yutu.pump.Pump`."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from yutu.errors import BindError
from yutu.protocol.codec import Channel
from yutu.pump import Pump

log = logging.getLogger("yutu.rpc")

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


def plain_socket(kind: int) -> zmq.Socket[Any]:
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
        self._sock = plain_socket(kind)
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
            raise BindError(f"{self.name}: cannot bind {host}:{port}: {exc}; pick another port") from exc

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
