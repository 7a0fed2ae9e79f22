"""KV events over ZeroMQ PUB/SUB: the publisher every holder of KV blocks runs, and the subscriber
the conductor runs. The wire shape is vLLM's (:mod:`yutu.protocol.kv_events`), so external routers
can consume the same stream.

    publisher (worker, store master)             subscriber (conductor)
    PUB     [topic, seq, batch] ---------------> SUB   apply(batch) if seq follows the last applied
    ROUTER  replay from seq     <--------------- DEALER on (re)start and after a gap
            [b"", seq, batch]* , END ---------->

A publisher keeps its last ``buffer_batches`` batches for replays. Given ``snapshot`` (the events
that rebuild its whole state: ``AllBlocksCleared`` then ``BlockStored`` of every key it holds), it
answers a replay that reaches further back than its buffer with that snapshot as one batch, so a
subscriber that starts late, or missed more than the buffer holds, still ends up with the exact
state. The subscriber applies batches in sequence order per publisher; on a gap it asks for a
replay from the first missing sequence number.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from yutu.protocol.kv_events import (
    END_SEQ,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
)
from yutu.pump import Pump
from yutu.rpc.sockets import bind, context, plain_socket
from yutu.supervise import cancel_and_wait

log = logging.getLogger(__name__)

Snapshot = Callable[[], list[KVEvent]]


class KVEventPublisher:
    def __init__(
        self,
        host: str,
        port: int,
        topic: str = "",
        data_parallel_rank: int = 0,
        replay_port: int | None = None,
        buffer_batches: int = 10_000,
        snapshot: Snapshot | None = None,
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
        self._snapshot = snapshot
        self._seq = 0
        self._lock = asyncio.Lock()  # keeps sequence numbers in send order
        self._replay_task: asyncio.Task[None] | None = None
        self.published_events = 0

    def start(self) -> asyncio.Task[None] | None:
        """Start serving replays (if a replay port was given); returns the task, for a supervisor."""
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-events-replay")
        return self._replay_task

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
            try:
                for seq, payload in self._replay_batches(int.from_bytes(start, "big")):
                    await self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
                await self._replay.send_multipart([identity, b"", END_SEQ, b""])
            except zmq.ZMQError as exc:  # the subscriber went away meanwhile
                log.info("KV event replay not delivered: %s", exc)

    def _replay_batches(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Buffered batches from ``start_seq``; a snapshot instead when the buffer starts later."""
        oldest = self._buffer[0][0] if self._buffer else self._seq
        if start_seq < oldest and self._snapshot is not None:
            # One batch standing for everything up to the last published seq.
            events = self._snapshot()
            last = self._seq - 1
            return [(last, encode_batch(KVEventBatch(time.time(), events, self.rank)))] if last >= 0 else []
        return [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]

    async def close(self) -> None:
        if self._replay_task is not None:
            await cancel_and_wait([self._replay_task], "KV event publisher")
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


@dataclass
class _Source:
    """One publisher the subscriber follows."""

    name: str
    endpoint: str
    replay_endpoint: str | None
    next_seq: int = 0  # the next sequence number to apply
    replaying: bool = False
    pending: list[tuple[int, KVEventBatch]] | None = None  # live batches held back during a replay


class KVEventSubscriber:
    """Follows many publishers; calls ``on_batch(source name, batch)`` in sequence order per source.

    ``follow(name, endpoint, replay_endpoint)`` subscribes and replays from the start (a snapshot
    where the publisher offers one); ``unfollow(name)`` stops. ``on_reset(name)`` is called before a
    replay from 0 is applied, so the caller can forget what it knew of that source.
    """

    def __init__(
        self,
        on_batch: Callable[[str, KVEventBatch], None],
        on_reset: Callable[[str], None],
        replay_timeout_s: float = 5.0,
    ) -> None:
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._replay_timeout_s = replay_timeout_s
        self._sources: dict[str, _Source] = {}
        self._pumps: dict[str, Pump] = {}  # one SUB socket per source, read from the event loop
        self._tasks: dict[str, asyncio.Task[None]] = {}  # replays in progress
        self.gaps = 0  # sequence gaps seen (each answered by a replay)

    @property
    def sources(self) -> list[str]:
        return sorted(self._sources)

    def follows(self, name: str, endpoint: str) -> bool:
        source = self._sources.get(name)
        return source is not None and source.endpoint == endpoint

    def follow(self, name: str, endpoint: str, replay_endpoint: str | None) -> None:
        if name in self._sources:
            self.unfollow(name)
        source = _Source(name, endpoint, replay_endpoint)
        self._sources[name] = source
        sock = plain_socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        pump = Pump(sock, lambda frames: self._on_frames(source, frames), f"kv-events-{name}")
        self._pumps[name] = pump
        pump.attach()
        self._start_replay(source, 0)

    def unfollow(self, name: str) -> None:
        self._sources.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        pump = self._pumps.pop(name, None)
        if pump is not None:
            pump.close()

    def _on_frames(self, source: _Source, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("KV events from %s: dropping a message of %d frames", source.name, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decode_batch(frames[2])
        except KVEventDecodeError as exc:
            log.warning("KV events from %s: dropping batch %d: %s", source.name, seq, exc)
            source.next_seq = max(source.next_seq, seq + 1)
            return
        self._live(source, seq, batch)

    def _live(self, source: _Source, seq: int, batch: KVEventBatch) -> None:
        if source.replaying:
            assert source.pending is not None
            source.pending.append((seq, batch))
            return
        if seq < source.next_seq:
            return  # already applied (from a replay)
        if seq > source.next_seq:
            self.gaps += 1
            log.info(
                "KV events from %s: batches %d..%d missed; replaying", source.name, source.next_seq, seq - 1
            )
            start = source.next_seq
            self._start_replay(source, start)
            assert source.pending is not None
            source.pending.append((seq, batch))
            return
        self._apply(source, seq, batch)

    def _apply(self, source: _Source, seq: int, batch: KVEventBatch) -> None:
        source.next_seq = seq + 1
        try:
            self._on_batch(source.name, batch)
        except Exception:  # noqa: BLE001 - one bad batch must not stop following this source
            log.exception("KV events from %s: applying batch %d failed", source.name, seq)

    def _start_replay(self, source: _Source, start: int) -> None:
        if source.replay_endpoint is None:
            if start == 0:
                return  # nothing to replay from: follow live from here
            source.next_seq = start  # no way to fill the gap: accept it
            return
        source.replaying = True
        source.pending = []
        task = asyncio.create_task(self._replay(source, start), name=f"kv-events-replay-{source.name}")
        self._tasks[source.name] = task

    async def _replay(self, source: _Source, start: int) -> None:
        assert source.replay_endpoint is not None
        sock = context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(source.replay_endpoint)
        batches: list[tuple[int, KVEventBatch]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 3 or frames[1] == END_SEQ:
                        break
                    try:
                        batches.append((int.from_bytes(frames[1], "big"), decode_batch(frames[2])))
                    except KVEventDecodeError as exc:
                        log.warning("KV events from %s: bad replay batch: %s", source.name, exc)
        except TimeoutError:
            log.warning("KV event replay from %s timed out; following live events only", source.name)
        finally:
            sock.close(linger=0)
        if self._sources.get(source.name) is not source:
            return  # unfollowed meanwhile
        if start == 0:
            self._on_reset(source.name)
            source.next_seq = 0
        for seq, batch in batches:
            if seq >= source.next_seq or start == 0:
                self._apply(source, seq, batch)
        pending, source.pending, source.replaying = source.pending or [], None, False
        for seq, batch in pending:
            self._live(source, seq, batch)

    async def close(self) -> None:
        for name in list(self._sources):
            self.unfollow(name)
        await cancel_and_wait(list(self._tasks.values()), "KV event subscriber")
        self._tasks.clear()
