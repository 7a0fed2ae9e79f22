"""The gateway's view of the prefill instances serving its model, and the prefill-channel client to each.

:class:`PrefillPool` re-reads the registry (kind ``prefill``) in a supervised loop, keeps one
:class:`PrefillClient` per instance, and pings each every ``ping_interval_s``: an instance whose
TCP connection drops, or that does not answer within the liveness window (frozen), gets no new
requests and the calls in flight to it fail at once with UNAVAILABLE -- the caller places the
request again elsewhere. :meth:`PrefillPool.pick` is the local choice used when the conductor is
unreachable (fewest calls in flight from this gateway).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from redis.exceptions import RedisError
from yutu.errors import ErrorKind, YutuError
from yutu.liveness import Liveness
from yutu.protocol import prefill as p
from yutu.registry import Registry, ServiceRecord
from yutu.rpc import RpcClient
from yutu.rpc.stream import StreamRpcClient, client_for, preferred_endpoint
from yutu.supervise import Supervisor

log = logging.getLogger(__name__)

PREFILL_KIND = "prefill"


class PrefillClient:
    def __init__(self, record: ServiceRecord, liveness: Liveness[str], timeout_s: float) -> None:
        self.record = record
        self.instance_id = record.instance_id
        self.endpoint = preferred_endpoint(record.endpoints, "prefill")
        self.in_flight = 0
        self.connected = False
        self._liveness = liveness
        self._pings = itertools.count()
        self._lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        liveness.watch(self.instance_id)
        self.rpc: RpcClient | StreamRpcClient = client_for(
            p.CHANNEL, record.endpoints, "prefill", timeout_s, self._on_connection
        )

    @property
    def broken(self) -> str | None:
        value = self.record.meta.get("broken")
        return str(value) if value else None

    @property
    def usable(self) -> bool:
        return (
            not self._lost.done() and not self._liveness.is_silent(self.instance_id) and self.broken is None
        )

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        """An RPC to this instance that fails with UNAVAILABLE as soon as the instance is lost."""
        if self._lost.done():
            raise YutuError(
                f"prefill instance {self.instance_id} {self._lost.result()}", ErrorKind.UNAVAILABLE
            )
        lost = self._lost
        task = asyncio.ensure_future(self.rpc.call(msg, timeout_s))
        self.in_flight += 1
        try:
            done, _ = await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            raise YutuError(
                f"prefill instance {self.instance_id} {lost.result()}: retry", ErrorKind.UNAVAILABLE
            )
        finally:
            self.in_flight -= 1
            if not task.done():
                task.cancel()

    def release(self, request_id: str) -> None:
        """Tell the instance to drop the request (prefilling or held); best effort, in the background.

        Sent even to an instance judged lost: a frozen one that wakes up reads it and frees the KV.
        """
        task = asyncio.ensure_future(self.rpc.call(p.ReleaseKV(request_id), 2.0))
        task.add_done_callback(_log_failure(f"releasing {request_id} on {self.instance_id}"))

    def ping(self) -> None:
        task = asyncio.ensure_future(self.rpc.call(p.Ping(next(self._pings)), self._liveness.timeout_s))
        task.add_done_callback(self._on_pong)

    def _on_pong(self, task: asyncio.Future[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        if self._liveness.heard(self.instance_id):
            log.warning("prefill instance %s answers again: back in rotation", self.instance_id)
        if self._lost.done() and self.connected:
            self._lost = asyncio.get_running_loop().create_future()

    def _on_connection(self, up: bool) -> None:
        self.connected = up
        if not up:
            self.lose("disconnected")

    def lose(self, why: str) -> None:
        if not self._lost.done():
            log.warning("prefill instance %s %s: failing %d call(s)", self.instance_id, why, self.in_flight)
            self._lost.set_result(why)

    async def close(self) -> None:
        self.lose("left the pool")
        self._liveness.forget(self.instance_id)
        await self.rpc.close()


def _log_failure(what: str) -> Any:
    def done(task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.info("%s failed: %s", what, task.exception())

    return done


class PrefillPool:
    def __init__(
        self,
        registry: Registry,
        model: str,
        loops: Supervisor,
        poll_s: float = 1.0,
        liveness_timeout_s: float = 3.0,
        call_timeout_s: float = 120.0,
    ) -> None:
        self.registry = registry
        self.model = model
        self.loops = loops
        self.poll_s = poll_s
        self.call_timeout_s = call_timeout_s
        self.liveness = Liveness[str](liveness_timeout_s)
        self.ping_interval_s = min(1.0, liveness_timeout_s / 3)
        self.instances: dict[str, PrefillClient] = {}

    async def start(self) -> None:
        await self.refresh()
        self.loops.every("prefill-pool", self.poll_s, self._poll)
        self.loops.every("prefill-liveness", self.ping_interval_s, self.check_liveness)

    async def _poll(self) -> None:
        try:
            await self.refresh()
        except (RedisError, OSError) as exc:
            log.warning("cannot read the prefill registry (keeping the last known instances): %s", exc)

    async def refresh(self) -> None:
        records = {
            r.instance_id: r
            for r in await self.registry.list(PREFILL_KIND)
            if r.meta.get("model") == self.model and "prefill" in r.endpoints
        }
        for instance_id in [i for i in self.instances if i not in records]:
            if self.instances[instance_id].in_flight == 0:
                log.info("prefill instance %s left", instance_id)
                await self.instances.pop(instance_id).close()
        for instance_id, record in records.items():
            current = self.instances.get(instance_id)
            endpoint = preferred_endpoint(record.endpoints, "prefill")
            if current is not None and current.endpoint != endpoint:
                await self.instances.pop(instance_id).close()  # restarted on another port
                current = None
            if current is None:
                log.info("prefill instance %s joined at %s", instance_id, endpoint)
                self.instances[instance_id] = PrefillClient(record, self.liveness, self.call_timeout_s)
            else:
                current.record = record

    def check_liveness(self) -> None:
        for silent in self.liveness.expired():
            client = self.instances.get(silent.key)
            if client is not None:
                client.lose(f"stopped answering for {silent.silence_s:.1f} s")
        for client in self.instances.values():
            client.ping()

    def get(self, instance_id: str) -> PrefillClient | None:
        client = self.instances.get(instance_id)
        return client if client is not None and client.usable else None

    def pick(self, exclude: frozenset[str] = frozenset()) -> PrefillClient | None:
        """The usable instance with the fewest calls in flight (None: there is none)."""
        candidates = [c for c in self.instances.values() if c.usable and c.instance_id not in exclude]
        return min(candidates, key=lambda c: (c.in_flight, c.instance_id), default=None)

    async def close(self) -> None:
        for client in self.instances.values():
            await client.close()
        self.instances.clear()
