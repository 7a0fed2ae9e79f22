"""The gateway's client to the conductor: ``Place`` before a request runs, ``Observed`` after its
first token, ``Finished`` when it ended. The conductor is found in the registry (kind ``conductor``). While it is unreachable
the gateway places requests itself (least loaded) and counts each such fallback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import RedisError
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import conductor as c
from yutu.registry import Registry
from yutu.rpc import RpcClient
from yutu.rpc.stream import StreamRpcClient, client_for, preferred_endpoint
from yutu.supervise import Supervisor

log = logging.getLogger(__name__)

CONDUCTOR_KIND = "conductor"


class ConductorClient:
    def __init__(
        self, registry: Registry, loops: Supervisor, poll_s: float = 1.0, timeout_s: float = 1.0
    ) -> None:
        self.registry = registry
        self.loops = loops
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.endpoint: str | None = None
        self.instance_id: str | None = None
        self._rpc: RpcClient | StreamRpcClient | None = None
        self.fallbacks = 0  # placements made here because the conductor did not answer

    async def start(self) -> None:
        await self.refresh()
        self.loops.every("conductor-discovery", self.poll_s, self._poll)

    async def _poll(self) -> None:
        try:
            await self.refresh()
        except (RedisError, OSError) as exc:
            log.warning("cannot read the conductor's registry record: %s", exc)

    async def refresh(self) -> None:
        records = await self.registry.list(CONDUCTOR_KIND)
        record = next((r for r in records if "rpc" in r.endpoints), None)
        endpoint = None if record is None else preferred_endpoint(record.endpoints, "rpc")
        if endpoint == self.endpoint:
            return
        if self._rpc is not None:
            await self._rpc.close()
            self._rpc = None
        self.endpoint = endpoint
        self.instance_id = None if record is None else record.instance_id
        if record is not None:
            log.info("conductor %s at %s", self.instance_id, endpoint)
            self._rpc = client_for(c.CHANNEL, record.endpoints, "rpc", self.timeout_s)
        else:
            log.warning("no conductor in the registry: placing requests here (least loaded)")

    @property
    def available(self) -> bool:
        return self._rpc is not None

    async def place(self, msg: c.Place) -> c.Placement | c.Rejected | None:
        """The conductor's answer, or None when it cannot be asked (the caller falls back)."""
        if self._rpc is None:
            return None
        try:
            reply = await self._rpc.call(msg, self.timeout_s)
        except YutuError as exc:
            if exc.kind is ErrorKind.INVALID_REQUEST:
                raise
            log.warning("the conductor did not place %s (%s): placing it here", msg.request_id, exc)
            return None
        if not isinstance(reply, c.Placement | c.Rejected):
            raise YutuError(f"the conductor answered {type(reply).__name__} to Place", ErrorKind.INTERNAL)
        return reply

    def observed(self, msg: c.Observed) -> None:
        """Report a request's measured TTFT (in the background; nothing waits for it)."""
        self._tell(msg)

    def finished(self, request_id: str) -> None:
        """Say a placed request ended (in the background; nothing waits for it)."""
        self._tell(c.Finished(request_id))

    def _tell(self, msg: c.Observed | c.Finished) -> None:
        if self._rpc is None:
            return
        task = asyncio.ensure_future(self._rpc.call(msg, self.timeout_s))
        task.add_done_callback(_ignore)

    async def close(self) -> None:
        if self._rpc is not None:
            await self._rpc.close()


def _ignore(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a lost report is not worth a log line per request
