"""Typed PUB/SUB (:mod:`yutu.rpc`) on ZeroMQ: one publisher, any number of subscribers, messages of one channel.

For reports that only the latest matters of (load reports to the conductor): a publisher never
blocks and never queues for a subscriber that is not there; a subscriber that (re)connects simply
gets the next message. Frames are ``[payload]`` (a :class:`~yutu.protocol.codec.Channel` frame).
Undecodable frames are logged and dropped.

    publisher = Publisher(LOAD, host, 0)               # bind; publisher.endpoint goes in the registry
    publisher.publish(LoadReport(...))
    subscriber = Subscriber(LOAD, on_message)           # on_message(source, msg)
    subscriber.follow("prefill-0", endpoint)            # connect; unfollow() disconnects
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from yutu.protocol.codec import Channel, ProtocolError
from yutu.pump import Pump
from yutu.rpc.sockets import bind, plain_socket

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, channel: Channel, host: str, port: int = 0, high_water_mark: int = 100) -> None:
        self.channel = channel
        self._sock = plain_socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, high_water_mark)
        self.endpoint = bind(self._sock, host, port)
        self.dropped = 0  # messages not sent (queue full)

    def publish(self, msg: Any) -> None:
        try:
            self._sock.send(self.channel.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._sock.close(linger=0)


class Subscriber:
    """One SUB socket per followed source, so every message is known by where it came from."""

    def __init__(self, channel: Channel, on_message: Callable[[str, Any], None]) -> None:
        self.channel = channel
        self._on_message = on_message
        self._pumps: dict[str, tuple[str, Pump]] = {}  # source -> (endpoint, pump)
        self.dropped = 0

    def follows(self, source: str, endpoint: str) -> bool:
        current = self._pumps.get(source)
        return current is not None and current[0] == endpoint

    @property
    def sources(self) -> list[str]:
        return sorted(self._pumps)

    def follow(self, source: str, endpoint: str) -> None:
        """Receive ``source``'s messages from ``endpoint`` (replacing an older endpoint of it)."""
        self.unfollow(source)
        sock = plain_socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        pump = Pump(sock, lambda frames: self._on_frames(source, frames), f"sub-{self.channel.name}-{source}")
        self._pumps[source] = (endpoint, pump)
        pump.attach()

    def unfollow(self, source: str) -> None:
        current = self._pumps.pop(source, None)
        if current is not None:
            current[1].close()

    def _on_frames(self, source: str, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.dropped += 1
            log.warning("%s from %s: dropping a message of %d frames", self.channel.name, source, len(frames))
            return
        try:
            msg = self.channel.decode(frames[0])
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("%s from %s: dropping an undecodable message: %s", self.channel.name, source, exc)
            return
        self._on_message(source, msg)

    def close(self) -> None:
        for source in list(self._pumps):
            self.unfollow(source)
