"""The master's KV event publisher: ZeroMQ PUB in vLLM's shape (:mod:`yutu.protocol.kv_events`),
plus an optional replay ROUTER serving the last ``buffer_batches`` batches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import zmq
import zmq.asyncio
from yutu.protocol.kv_events import END_SEQ, KVEvent, KVEventBatch, encode_batch
from yutu.rpc import bind, context

log = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(
        self,
        host: str,
        port: int,
        topic: str = "",
        data_parallel_rank: int = 0,
        replay_port: int | None = None,
        buffer_batches: int = 10_000,
    ) -> None:
        self.topic = topic.encode("utf-8")
        self.rank = data_parallel_rank
        self._pub = context().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = bind(self._pub, host, port)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_port is not None:
            self._replay = context().socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = bind(self._replay, host, replay_port)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self._lock = asyncio.Lock()  # keeps sequence numbers in send order
        self._replay_task: asyncio.Task[None] | None = None
        self.published_events = 0

    def start(self) -> None:
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-events-replay")

    async def publish(self, events: list[KVEvent]) -> None:
        """Send ``events`` as one batch (nothing when empty)."""
        if not events:
            return
        payload = encode_batch(KVEventBatch(time.time(), events, self.rank))
        async with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.published_events += len(events)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring malformed KV event replay request with %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await self._replay.send_multipart([identity, b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
