"""Finding and calling the store master.

The master is found through an explicit endpoint (``tcp://host:port``, ZeroMQ) or through the
registry (kind ``store-master``; the most recently started live instance wins). From the registry
the client takes the master's plain TCP stream endpoint (``rpc_stream``, :mod:`yutu.rpc.stream`:
no ZeroMQ I/O-thread hops, ~100 us less per call on a small host) when it is advertised and
``stream`` is on, else its ZeroMQ one (``rpc``, the reference). When a call finds the master
unreachable and the registry now names another endpoint (the master restarted on a new port), the
client switches to it and retries once; otherwise the error goes up.

:attr:`MasterClient.session` changes when the stream connection to the master drops: a writer's
reservations (:mod:`yutu.store.reservations`) are good only in the session they were made in,
since a restarted master has forgotten them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.registry import Registry
from yutu.rpc import RpcClient
from yutu.rpc.stream import NotConnectedError, StreamRpcClient

log = logging.getLogger(__name__)

MASTER_KIND = "store-master"
STREAM = "rpc_stream"  # the registry endpoint of the master's stream RPC


async def find_master(registry: Registry, stream: bool = False) -> str:
    """The RPC endpoint of the live store master in ``registry`` (its ``rpc_stream`` one when
    ``stream`` and it has one); UNAVAILABLE if there is none."""
    records = [r for r in await registry.list(MASTER_KIND) if "rpc" in r.endpoints]
    if not records:
        raise YutuError(
            f"no store master is registered under prefix {registry.prefix!r}: start `yutu store-master` "
            "or pass its endpoint with --master",
            ErrorKind.UNAVAILABLE,
        )
    endpoints = max(records, key=lambda r: r.started_at).endpoints
    return "stream+" + endpoints[STREAM] if stream and STREAM in endpoints else endpoints["rpc"]


FIND_AGAIN_S = 0.25  # a stream endpoint from the registry that refuses: read the registry again this often


def _rpc_client(
    endpoint: str, timeout_s: float, found: bool, on_connection: Callable[[bool], None], spin_s: float
) -> RpcClient | StreamRpcClient:
    """``stream+tcp://...``: the stream RPC (waiting for replies awake for ``spin_s``, see
    ``yutu.busypoll``); ``tcp://...``: ZeroMQ. ``found`` (in the registry): connection attempts give
    up after FIND_AGAIN_S, for the caller to look the master up again."""
    if endpoint.startswith("stream+"):
        connect_timeout = FIND_AGAIN_S if found else None
        return StreamRpcClient(
            p.CHANNEL, endpoint.removeprefix("stream+"), timeout_s, connect_timeout, on_connection, spin_s
        )
    return RpcClient(p.CHANNEL, endpoint, timeout_s)


class MasterClient:
    """RPC client of the store channel that follows the master across restarts."""

    def __init__(
        self,
        endpoint: str | None,
        registry: Registry | None,
        timeout_s: float = 10.0,
        stream: bool = True,
        spin_s: float = 0.0,
    ) -> None:
        """``endpoint``: the master's ZeroMQ endpoint, or ``stream+tcp://host:port`` for its stream
        one; None: found in ``registry`` (``stream``: prefer the stream endpoint). ``spin_s``: how
        long a stream call waits for its reply awake before sleeping (``yutu.busypoll``)."""
        if endpoint is None and registry is None:
            raise ValueError("give the master's endpoint or a registry to find it in")
        self._fixed = endpoint
        self.registry = registry
        self.timeout_s = timeout_s
        self.stream = stream
        self.spin_s = spin_s
        self._rpc: RpcClient | StreamRpcClient | None = None
        self._address: str | None = None  # the endpoint _rpc talks to, as find_master names it
        self._lost = 0  # stream connections lost, and moves to another endpoint (see session)

    @property
    def session(self) -> int | None:
        """Changes whenever the stream connection to the master drops or the client moves to
        another endpoint: a reply to a call made when the session was ``s`` came from the master of
        session ``s``. None when the master is reached over ZeroMQ (no connection to watch)."""
        return self._lost if isinstance(self._rpc, StreamRpcClient) else None

    def _connection_changed(self, up: bool) -> None:
        if not up:
            self._lost += 1

    @property
    def endpoint(self) -> str | None:
        return self._address

    async def connect(self) -> None:
        endpoint = self._fixed
        if endpoint is None:
            assert self.registry is not None
            endpoint = await find_master(self.registry, self.stream)
        if self._rpc is not None and self._address == endpoint:
            return
        old, self._rpc, self._address = (
            self._rpc,
            _rpc_client(endpoint, self.timeout_s, self._fixed is None, self._connection_changed, self.spin_s),
            endpoint,
        )
        if old is not None:
            self._lost += 1
            log.info("store master moved from %s to %s", old.endpoint, endpoint)
            await old.close()

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        """The master's reply to ``msg``. A stream endpoint that refuses connections (the master
        restarting, maybe on another port) is looked up again until the call's timeout; a call that
        may have reached a master is never sent twice to the same one."""
        if self._rpc is None:
            await self.connect()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            rpc = self._rpc
            assert rpc is not None
            try:
                return await rpc.call(msg, max(0.001, deadline - time.monotonic()))
            except NotConnectedError:
                if self._fixed is not None or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.01)
                try:
                    await self.connect()  # the same endpoint again, or where the master is now
                except YutuError:
                    pass
            except YutuError as exc:
                if exc.kind is not ErrorKind.UNAVAILABLE or self._fixed is not None or self._rpc is not rpc:
                    raise
                try:
                    await self.connect()
                except YutuError:
                    raise exc from None
                if self._rpc is rpc or self._rpc is None:
                    raise
                return await self._rpc.call(msg, timeout_s)

    async def close(self) -> None:
        if self._rpc is not None:
            await self._rpc.close()
            self._rpc = None
            self._address = None
