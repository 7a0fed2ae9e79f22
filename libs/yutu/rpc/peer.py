"""Streaming channels of :mod:`yutu.rpc`: typed messages, one handler per message type."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import zmq

from yutu.logs import about
from yutu.protocol.codec import Channel
from yutu.rpc.sockets import Endpoint, OnConnection, Sent

MessageHandler = Callable[[bytes, Any], None]  # streaming: (sender identity, b"" on a DEALER; msg)


def check_handlers(channel: Channel, handlers: Mapping[type[Any], MessageHandler]) -> None:
    """Raises TypeError unless every handled type is a message of ``channel``."""
    unknown = [cls.__name__ for cls in handlers if cls not in channel.messages]
    if unknown:
        raise TypeError(f"{', '.join(unknown)} not message(s) of channel {channel.name}")


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
        check_handlers(channel, handlers)
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
        with about(msg):
            handler(frames[0] if self._router else b"", msg)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket (idempotent); for ``linger_s`` queued messages still go out."""
        self._close_socket(linger_s)
