"""Finding and calling the store master.

The master is found through an explicit endpoint (``tcp://host:port``) or through the registry
(kind ``store-master``, endpoint ``rpc``; the most recently started live instance wins). When a
call finds the master unreachable and the registry now names another endpoint (the master
restarted on a new port), the client switches to it and retries once; otherwise the error goes up.
"""

from __future__ import annotations

import logging
from typing import Any

from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p
from yutu.registry import Registry
from yutu.rpc import RpcClient

log = logging.getLogger(__name__)

MASTER_KIND = "store-master"


async def find_master(registry: Registry) -> str:
    """The RPC endpoint of the live store master in ``registry``; UNAVAILABLE if there is none."""
    records = [r for r in await registry.list(MASTER_KIND) if "rpc" in r.endpoints]
    if not records:
        raise YutuError(
            f"no store master is registered under prefix {registry.prefix!r}: start `yutu store-master` "
            "or pass its endpoint with --master",
            ErrorKind.UNAVAILABLE,
        )
    return max(records, key=lambda r: r.started_at).endpoints["rpc"]


class MasterClient:
    """RPC client of the store channel that follows the master across restarts."""

    def __init__(self, endpoint: str | None, registry: Registry | None, timeout_s: float = 10.0) -> None:
        if endpoint is None and registry is None:
            raise ValueError("give the master's endpoint or a registry to find it in")
        self._fixed = endpoint
        self.registry = registry
        self.timeout_s = timeout_s
        self._rpc: RpcClient | None = None

    @property
    def endpoint(self) -> str | None:
        return None if self._rpc is None else self._rpc.endpoint

    async def connect(self) -> None:
        endpoint = self._fixed
        if endpoint is None:
            assert self.registry is not None
            endpoint = await find_master(self.registry)
        if self._rpc is not None and self._rpc.endpoint == endpoint:
            return
        old, self._rpc = self._rpc, RpcClient(p.CHANNEL, endpoint, self.timeout_s)
        if old is not None:
            log.info("store master moved from %s to %s", old.endpoint, endpoint)
            await old.close()

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        if self._rpc is None:
            await self.connect()
        rpc = self._rpc
        assert rpc is not None
        try:
            return await rpc.call(msg, timeout_s)
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
