"""Helpers of the worker tests."""

from __future__ import annotations

import asyncio
from typing import Any

from yutu.protocol.generate import CHANNEL, Pong, RequestFailed, TokenDelta, TokenDeltas
from yutu.rpc import Sent, StreamPeer


class Dealer:
    """The generate channel as a front end sees it: a real dealer, each message it receives queued in order."""

    def __init__(self, endpoint: str) -> None:
        self.received: asyncio.Queue[Any] = asyncio.Queue()
        self.peer = StreamPeer.dealer(
            CHANNEL,
            {TokenDelta: self._got, TokenDeltas: self._got, RequestFailed: self._got, Pong: self._got},
            endpoint,
        )

    def _got(self, _: bytes, msg: Any) -> None:
        self.received.put_nowait(msg)

    def send(self, msg: Any) -> None:
        assert self.peer.send(msg) is Sent.SENT

    async def recv(self, timeout_s: float = 60) -> Any:
        return await asyncio.wait_for(self.received.get(), timeout_s)

    async def recv_within(self, timeout_s: float) -> Any | None:
        """The next message, or None if none arrives within ``timeout_s``."""
        try:
            return await asyncio.wait_for(self.received.get(), timeout_s)
        except TimeoutError:
            return None

    def close(self) -> None:
        self.peer.close()
