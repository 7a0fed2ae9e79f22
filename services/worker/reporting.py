"""What a prefill or decode instance tells the conductor: its prefix cache and its load.

- KV events (vLLM's shape, :mod:`yutu.rpc.kv_events`): every key the engine's prefix cache stores or
  evicts, published in order; a replay from the start gets a snapshot of the cache (kept here as a
  mirror of the keys, on the event loop). Blocks pinned for write-behind are handed on.
- Load reports (:mod:`yutu.protocol.load`): every ``interval_s``, the queue, the running batch, free
  blocks and the measurements (prefill times, decode steps, transfers) since the last report.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

from yutu.kv.block_manager import CacheEvent
from yutu.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from yutu.protocol.load import CHANNEL as LOAD
from yutu.protocol.load import LoadReport
from yutu.rpc import KVEventPublisher, Publisher
from yutu.supervise import Supervisor
from yutu.worker.write_behind import WriteBehind

from services.worker.engine_core import LoadState
from services.worker.engine_loop import EngineFront


class CacheEvents:
    """Publishes the engine's prefix-cache changes and feeds write-behind (the engine front's on_cache)."""

    def __init__(
        self,
        host: str,
        block_size: int,
        medium: str,
        supervisor: Supervisor,
        write_behind: WriteBehind | None,
    ) -> None:
        self.block_size = block_size
        self.medium = medium
        self.keys: set[bytes] = set()  # mirror of the engine's prefix cache (what a snapshot sends)
        self.write_behind = write_behind
        self.publisher = KVEventPublisher(host, 0, replay_port=0, snapshot=self.snapshot)
        self._queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        replay = self.publisher.start()
        if replay is not None:
            supervisor.watch("kv-events-replay", replay)
        supervisor.spawn("kv-events", self._run())

    def on_cache(self, events: list[CacheEvent], pinned: list[tuple[bytes, int]]) -> None:
        out: list[KVEvent] = []
        for event in events:
            if event.stored:
                self.keys.add(event.key)
                out.append(BlockStored([event.key], block_size=self.block_size, medium=self.medium))
            else:
                self.keys.discard(event.key)
                out.append(BlockRemoved([event.key], medium=self.medium))
        if out:
            self._queue.put_nowait(out)
        if pinned and self.write_behind is not None:
            self.write_behind.offer([(key.hex(), block_id) for key, block_id in pinned])

    def snapshot(self) -> list[KVEvent]:
        events: list[KVEvent] = [AllBlocksCleared()]
        if self.keys:
            events.append(BlockStored(sorted(self.keys), block_size=self.block_size, medium=self.medium))
        return events

    async def _run(self) -> None:
        while True:
            await self.publisher.publish(await self._queue.get())

    async def close(self) -> None:
        await self.publisher.close()


class LoadReporter:
    """Publishes a LoadReport every ``interval_s`` (a supervised loop)."""

    def __init__(
        self,
        host: str,
        instance_id: str,
        role: str,
        engine_loop: EngineFront,
        block_size: int,
        extra: Callable[[], tuple[int, list[list[float]]]],  # (held requests, transfers since last)
        supervisor: Supervisor,
        interval_s: float = 0.2,
    ) -> None:
        self.instance_id = instance_id
        self.role = role
        self.engine_loop = engine_loop
        self.block_size = block_size
        self._extra = extra
        self._seq = itertools.count(1)
        self.publisher = Publisher(LOAD, host, 0)
        self._closed = False
        supervisor.every("load-reports", interval_s, self.publish)

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    def publish(self) -> None:
        if self._closed:  # shutting down: the supervised loop may tick once more after close()
            return
        self.publisher.publish(self.report())

    def report(self) -> LoadReport:
        """The next report (taking the measurements made since the previous one)."""
        stats = self.engine_loop.stats
        load: LoadState = self.engine_loop.load
        held, transfers = self._extra()
        msg = LoadReport(
            instance_id=self.instance_id,
            role=self.role,
            seq=next(self._seq),
            time=time.time(),
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_held=held,
            free_blocks=stats.num_free_blocks,
            total_blocks=stats.num_kv_blocks,
            block_size=self.block_size,
            queued=load.queued,
            decoding=load.decoding,
            prefills=LoadState.drain(load.prefills),
            steps=LoadState.drain(load.steps),
            transfers=transfers,
        )
        return msg

    def close(self) -> None:
        self._closed = True
        self.publisher.close()
