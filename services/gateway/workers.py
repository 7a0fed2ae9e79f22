"""The gateway's view of the workers serving its model.

:class:`WorkerPool` keeps one :class:`~services.gateway.worker_client.WorkerClient` per worker and
runs two supervised loops on the service's :class:`~yutu.supervise.Supervisor`:

- ``worker-pool`` re-reads the registry every ``poll_s`` seconds: connects to new workers, drops
  vanished ones and fails their in-flight requests, skips records that do not describe a worker
  and workers whose meta says ``"broken"`` (each logged once);
- ``worker-liveness`` pings every worker every ``ping_interval_s`` and fails the requests of one
  silent past ``liveness_timeout_s`` (it gets no new requests until it answers again).

Each step of either loop survives bad data and transient errors (logged); if a loop dies anyway,
the supervisor makes the gateway not ready and names it. :meth:`WorkerPool.pick` chooses a worker
for each new request: fewest in-flight requests from this gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Collection
from typing import Any

from redis.exceptions import RedisError
from yutu.errors import ErrorKind, YutuError
from yutu.liveness import Liveness
from yutu.registry import Registry, ServiceRecord
from yutu.supervise import Supervisor, cancel_and_wait

from services.gateway.worker_client import GenerationHandle, WorkerClient, WorkerInfo

__all__ = ["WORKER_KIND", "GenerationHandle", "WorkerClient", "WorkerInfo", "WorkerPool"]

log = logging.getLogger(__name__)

WORKER_KIND = "worker"


class WorkerPool:
    """Workers of one model, kept in sync with the registry and judged by their heartbeats.

    The registry says who to send *new* requests to; the connection and the heartbeats say who is
    alive. A worker whose record disappears (it is draining, or Redis lost its data) keeps its
    in-flight requests and is picked only when no listed worker can serve; it leaves the pool when
    its connection drops, or once it is idle and has stayed unlisted for ``grace_s`` (a registry
    TTL). A worker silent past the liveness window is not picked until it answers again.
    """

    def __init__(
        self,
        registry: Registry,
        model: str,
        loops: Supervisor,
        poll_s: float = 1.0,
        grace_s: float = 10.0,
        liveness_timeout_s: float = 3.0,
        kind: str = WORKER_KIND,
    ) -> None:
        self.kind = kind  # "worker" (mixed workers) or "decode" (decode instances)
        self.registry = registry
        self.model = model
        self.loops = loops
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.liveness = Liveness[str](liveness_timeout_s)
        self.ping_interval_s = min(1.0, liveness_timeout_s / 3)  # three pings per window at least
        self.workers: dict[str, WorkerClient] = {}
        self._turn = itertools.count()
        self._last_pick: dict[str, int] = {}
        self._skipped: dict[str, str] = {}  # instance id -> why its record is not used (logged once)
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        """Read the registry once (raising if Redis is unreachable), then start the loops."""
        await self.refresh()
        self._tasks = [
            self.loops.every(f"{self.kind}-pool", self.poll_s, self._poll),
            self.loops.every(f"{self.kind}-liveness", self.ping_interval_s, self.check_liveness),
        ]

    async def _poll(self) -> None:
        try:
            await self.refresh()
        except (RedisError, OSError) as exc:
            log.warning("cannot read the worker registry (keeping the last known workers): %s", exc)

    def check_liveness(self) -> None:
        """Fail the requests of workers that turned silent, then ping every worker."""
        for silent in self.liveness.expired():
            worker = self.workers.get(silent.key)
            if worker is not None:
                worker.stopped_answering(silent.silence_s)
        for worker in self.workers.values():
            worker.ping()

    async def refresh(self) -> None:
        """Re-read the registry: connect new workers, retire unlisted ones, update the others' info."""
        seen = self._usable_records(await self.registry.list(self.kind))
        now = time.monotonic()
        for instance_id, worker in list(self.workers.items()):
            if instance_id in seen:
                continue
            if worker.unlisted_since is None:
                worker.unlisted_since = now
                log.info(
                    "worker %s is no longer listed: no new requests unless no other worker can serve",
                    instance_id,
                )
            if worker.lost or (worker.in_flight == 0 and now - worker.unlisted_since > self.grace_s):
                log.info("worker %s left", instance_id)
                await self.workers.pop(instance_id).close()
        for instance_id, info in seen.items():
            current = self.workers.get(instance_id)
            if current is not None and current.info.generate_endpoint != info.generate_endpoint:
                await self.workers.pop(instance_id).close()  # restarted on another port
                current = None
            if current is None:
                log.info("worker %s joined at %s", instance_id, info.generate_endpoint)
                self.workers[instance_id] = WorkerClient(info, self.liveness)
            else:
                current.info = info
                current.unlisted_since = None

    def _usable_records(self, records: list[ServiceRecord]) -> dict[str, WorkerInfo]:
        """Workers of our model whose record makes sense; a broken one is kept, marked (not picked)."""
        seen: dict[str, WorkerInfo] = {}
        skipped: dict[str, str] = {}
        for record in records:
            if record.meta.get("model") != self.model:
                continue
            try:
                info = WorkerInfo.from_record(record)
            except (KeyError, TypeError, ValueError) as exc:
                skipped[record.instance_id] = f"malformed worker record: {type(exc).__name__}: {exc}"
                continue
            if info.broken is not None:
                skipped[record.instance_id] = f"its engine is broken: {info.broken}"
            seen[record.instance_id] = info
        for instance_id, why in skipped.items():
            if self._skipped.get(instance_id) != why:
                log.warning("not sending requests to worker %s: %s", instance_id, why)
        self._skipped = skipped
        return seen

    def usable(self) -> list[WorkerClient]:
        return [w for w in self.workers.values() if w.usable]

    def live(self) -> list[WorkerClient]:
        """Usable workers known to answer their heartbeats."""
        return [w for w in self.workers.values() if w.live]

    def pick(self, exclude: frozenset[str] = frozenset()) -> WorkerClient:
        """The usable worker with the fewest in-flight requests (ties: the least recently picked).

        Listed workers come before unlisted ones, and workers that answered before ones still
        connecting (a registered worker whose process is gone never answers; it turns silent
        within the liveness window).
        """
        candidates = [w for w in self.usable() if w.info.instance_id not in exclude]
        if not candidates:
            what = "worker" if self.kind == WORKER_KIND else f"{self.kind} instance"
            raise YutuError(
                f"no {what} serving model {self.model!r} is available: start one with "
                f"`yutu {self.kind} --served-model-name {self.model}` (same --redis-url and --registry-prefix)",
                ErrorKind.UNAVAILABLE,
            )
        best = min(
            candidates,
            key=lambda w: (
                w.unlisted_since is not None,
                not w.answered,
                w.in_flight,
                self._last_pick.get(w.info.instance_id, -1),
                w.info.instance_id,
            ),
        )
        self._last_pick[best.info.instance_id] = next(self._turn)
        return best

    async def pick_within(self, wait_s: float, avoid: Collection[WorkerClient] = ()) -> WorkerClient:
        """As :meth:`pick`, never one of ``avoid`` (connections that lost the request; the same
        instance restarted is another connection, and may be picked), and when none is usable,
        waiting up to ``wait_s`` seconds for one to join (``yutu up`` restarts a lost instance in
        seconds; the registry shows it within ``poll_s``) before raising the 503."""
        deadline = time.monotonic() + wait_s
        while True:
            exclude = frozenset(
                w.info.instance_id for w in avoid if self.workers.get(w.info.instance_id) is w
            )
            try:
                return self.pick(exclude)
            except YutuError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    if wait_s <= 0:
                        raise
                    raise YutuError(f"{exc} (waited {wait_s:g}s for one)", exc.kind) from None
            await asyncio.sleep(min(0.1, left))

    @property
    def max_model_len(self) -> int | None:
        """The smallest context length among usable workers (None: no worker)."""
        lens = [w.info.max_model_len for w in self.usable()]
        return min(lens) if lens else None

    @property
    def demo(self) -> bool:
        return any(w.info.demo for w in self.workers.values())

    async def close(self) -> None:
        """Stop the loops and close every connection."""
        await cancel_and_wait(self._tasks, f"{self.kind} pool")
        for worker in self.workers.values():
            await worker.close()
        self.workers.clear()
