"""Write-behind: every new full KV block goes into the store, keyed by its chained hash.

The engine thread pins each block it registers in its prefix cache (an extra reference, so the
block is not handed to another sequence while it is copied) and offers it here. This module, on
the event loop, batches offered blocks into ``put_from_batch`` calls straight from the KV cache
region (no copy in this process), keeps at most ``max_in_flight`` blocks pinned, and unpins every
block it was offered exactly once -- written, already stored, skipped or failed. It is never on the
token path: offering returns at once, and a failed put is counted and logged, never raised.

    engine thread: step -> new full blocks -> pin -> offer(blocks)      (via the event loop)
    event loop:    queue -> (DELAY_S) -> put_from_batch(keys, kv region, offsets) -> unpin(block ids)

Offered blocks wait ``DELAY_S`` (20 ms) before they are written. A prefill instance offers a
prompt's blocks as its first token goes out, which is when the decode instance pulls them and runs
their first step: on a small host the put (the master's commit, the copies) ran on the same CPUs
and stretched that hand-off. Measured on 2 cores, 1P+1D, 25 sequential 1024-token prompts per run,
three alternating pairs: the gap between a request's first and second token 7.2-7.9 ms (p50) with
the delay against 8.2-12.2 ms without. The wait also lets blocks offered meanwhile share one put.

While the instance has prompts to prefill (``busy``) they wait longer, up to ``max_defer_s``, or
until half of ``max_in_flight`` is waiting: a burst of prompts is the time the store's work (our
copies and commits, the master's records, the conductor's events) competes with the prompts for
CPUs, and every one of those prompts' first tokens waits on the last of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from yutu.errors import YutuError
from yutu.store.client import StoreClient
from yutu.supervise import Supervisor

log = logging.getLogger(__name__)

DELAY_S = 0.02  # how long offered blocks wait before they are written (see the module docstring)
DEFER_POLL_S = 0.005  # how often a deferred write looks whether the instance still prefills
KNOWN_KEYS = 65_536  # keys remembered as stored, so a hot prefix is not offered again and again


@dataclass
class WriteBehindStats:
    written: int = 0  # blocks put into the store
    already_stored: int = 0  # the store had them (another instance wrote them first)
    known: int = 0  # not sent: remembered as stored
    skipped: int = 0  # not sent: too many in flight
    failed: int = 0  # the put failed (logged)
    deferred_s: float = 0.0  # time writes waited for the instance's prompts (about)


class WriteBehind:
    def __init__(
        self,
        store: StoreClient,
        region: str,
        block_bytes: int,
        unpin: Callable[[list[int]], None],
        supervisor: Supervisor,
        max_in_flight: int = 512,
        batch_blocks: int = 64,
        delay_s: float = DELAY_S,
        busy: Callable[[], bool] | None = None,
        max_defer_s: float = 0.0,
    ) -> None:
        if max_in_flight < 1 or batch_blocks < 1 or delay_s < 0 or max_defer_s < 0:
            raise ValueError(
                "write-behind needs max_in_flight >= 1, batch_blocks >= 1, delay_s >= 0 and max_defer_s >= 0"
            )
        self.delay_s = delay_s
        self.max_defer_s = max_defer_s
        self._busy = busy
        self.store = store
        self.region = region
        self.block_bytes = block_bytes
        self.max_in_flight = max_in_flight
        self.batch_blocks = batch_blocks
        self.stats = WriteBehindStats()
        self._unpin = unpin
        self._queue: list[tuple[str, int]] = []
        self._in_flight = 0  # queued or being written (all pinned)
        self._known: OrderedDict[str, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        supervisor.spawn("write-behind", self._run())

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def remember(self, keys: Sequence[str]) -> None:
        """Keys known to be in the store, or written by the instance that computed them (fetched from
        the store, pulled from a prefill instance): never offered for writing."""
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def offer(self, blocks: Sequence[tuple[str, int]]) -> None:
        """Take pinned blocks (store key, block id); each is unpinned once it is dealt with."""
        release: list[int] = []
        for key, block_id in blocks:
            if self._closed:
                release.append(block_id)
            elif key in self._known:
                self.stats.known += 1
                release.append(block_id)
            elif self._in_flight >= self.max_in_flight:
                self.stats.skipped += 1
                release.append(block_id)
            else:
                self._queue.append((key, block_id))
                self._in_flight += 1
        if release:
            self._unpin(release)
        if self._queue:
            self._idle.clear()
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            await self._defer()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.batch_blocks], self._queue[self.batch_blocks :]
                await self._write(batch)
            if not self._queue:
                self._idle.set()

    async def _defer(self) -> None:
        """Wait while the instance prefills: up to max_defer_s, or until half the budget waits."""
        if self._busy is None or not self.max_defer_s:
            return
        deadline = time.monotonic() + self.max_defer_s
        while self._busy() and self._in_flight < self.max_in_flight // 2 and time.monotonic() < deadline:
            self.stats.deferred_s += DEFER_POLL_S
            await asyncio.sleep(DEFER_POLL_S)

    async def _write(self, batch: list[tuple[str, int]]) -> None:
        keys = [k for k, _ in batch]
        block_ids = [b for _, b in batch]
        try:
            results = await self.store.put_from_batch_outcomes(
                keys, self.region, [b * self.block_bytes for b in block_ids], [self.block_bytes] * len(batch)
            )
        except (YutuError, OSError, ValueError) as exc:
            self.stats.failed += len(batch)
            log.warning("write-behind of %d KV blocks failed: %s", len(batch), exc)
        else:
            failed: list[tuple[str, YutuError]] = []
            for key, outcome in zip(keys, results, strict=True):
                if isinstance(outcome, YutuError):
                    failed.append((key, outcome))
                    continue
                if outcome:
                    self.stats.written += 1
                else:
                    self.stats.already_stored += 1
                self.remember([key])
            if failed:  # one line a batch: a lost store node fails every block of it alike
                self.stats.failed += len(failed)
                key, first = failed[0]
                log.warning(
                    "write-behind of %d of %d KV blocks failed; block %s: %s",
                    len(failed),
                    len(batch),
                    key,
                    first,
                )
        finally:
            self._in_flight -= len(batch)
            self._unpin(block_ids)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every offered block is dealt with; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Unpin what is still queued (not yet sent); later offers are unpinned at once."""
        self._closed = True
        if self._queue:
            queued, self._queue = self._queue, []
            self._in_flight -= len(queued)
            self._unpin([b for _, b in queued])
