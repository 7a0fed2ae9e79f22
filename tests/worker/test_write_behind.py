"""Write-behind's control logic over a recording store (the store itself is tested for real in
tests/store; the worker's write-behind against a real store in the disaggregation tests): offered
blocks wait the delay, blocks offered meanwhile share one put, every block is unpinned once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from yutu.supervise import Supervisor
from yutu.worker.write_behind import WriteBehind


class RecordingStore:
    """Answers every put as stored and records when it came and which keys it carried."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, list[str], list[int]]] = []

    async def put_from_batch_outcomes(
        self, keys: list[str], region: str, offsets: list[int], lengths: list[int]
    ) -> list[bool]:
        self.puts.append((time.monotonic(), list(keys), list(offsets)))
        return [True] * len(keys)


@asynccontextmanager
async def write_behind(delay_s: float) -> AsyncIterator[tuple[WriteBehind, RecordingStore, list[int]]]:
    """A write-behind of 100-byte blocks over a recording store; yields it, the store and the
    block ids it unpinned, in order."""
    store = RecordingStore()
    unpinned: list[int] = []
    supervisor = Supervisor("test")
    wb = WriteBehind(store, "kv", 100, unpinned.extend, supervisor, delay_s=delay_s)  # type: ignore[arg-type]
    try:
        yield wb, store, unpinned
    finally:
        wb.close()
        await supervisor.close()


async def test_offered_blocks_wait_the_delay_and_share_one_put() -> None:
    async with write_behind(0.05) as (wb, store, unpinned):
        offered_at = time.monotonic()
        wb.offer([("a", 1), ("b", 2)])
        await asyncio.sleep(0.01)
        wb.offer([("c", 3)])  # within the delay: joins the same put
        assert store.puts == [] and unpinned == []  # nothing written or unpinned before the delay
        assert await wb.flush(5.0)
        [(put_at, keys, offsets)] = store.puts
        assert put_at - offered_at >= 0.045  # (a timer may fire a hair early)
        assert keys == ["a", "b", "c"] and offsets == [100, 200, 300]
        assert sorted(unpinned) == [1, 2, 3] and wb.in_flight == 0
        assert wb.stats.written == 3
        wb.offer([("a", 4)])  # written already: unpinned at once, never sent again
        assert unpinned[-1] == 4 and len(store.puts) == 1 and wb.stats.known == 1


async def test_no_delay_writes_at_once() -> None:
    async with write_behind(0) as (wb, store, unpinned):
        wb.offer([("a", 1)])
        assert await wb.flush(5.0)
        assert [keys for _, keys, _ in store.puts] == [["a"]] and unpinned == [1]
