"""Driving a plain (non-blocking) ZeroMQ socket from the asyncio event loop, without futures.

A reader callback on the socket's notification descriptor drains every waiting message and hands
each to ``on_frames``; nothing awaits a receive, so a message costs no future and no task. Used by
every endpoint of :mod:`yutu.rpc`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger(__name__)

_DRAIN_BATCH = 64  # messages handled per reader callback before yielding to other callbacks


class Pump:
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

    def close(self, linger_s: float = 0.0) -> None:
        """Stop reading and close; for ``linger_s`` ZeroMQ still delivers what is queued (in the background)."""
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.FD)
        self.sock.close(linger=int(linger_s * 1000))
