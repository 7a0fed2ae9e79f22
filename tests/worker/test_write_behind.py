"""Write-behind's control logic over a recording store (the store itself is tested for real in
tests/store; the worker's write-behind against a real store in the disaggregation tests): offered
blocks wait the delay, blocks offered meanwhile share one put, every block is unpinned once, and
writes wait while the instance prefills (not past their bound)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from yutu.errors import ErrorKind, YutuError
from yutu.supervise import Supervisor
from yutu.worker.write_behind import WriteBehind


class RecordingStore:
    """Answers every put as stored, but the keys in ``failing`` as failed, and records when it came
    and which keys it carried."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, list[str], list[int]]] = []
        self.failing: set[str] = set()

    async def put_from_batch_outcomes(
        self, keys: list[str], region: str, offsets: list[int], lengths: list[int]
    ) -> list[bool | YutuError]:
        self.puts.append((time.monotonic(), list(keys), list(offsets)))
        return [
            YutuError(f"writing {k!r} failed", ErrorKind.UNAVAILABLE) if k in self.failing else True
            for k in keys
        ]


@asynccontextmanager
async def write_behind(
    delay_s: float, busy: Callable[[], bool] | None = None, max_defer_s: float = 0.0, max_in_flight: int = 512
) -> AsyncIterator[tuple[WriteBehind, RecordingStore, list[int]]]:
    """A write-behind of 100-byte blocks over a recording store; yields it, the store and the
    block ids it unpinned, in order."""
    store = RecordingStore()
    unpinned: list[int] = []
    supervisor = Supervisor("test")
    wb = WriteBehind(
        store, "kv", 100, unpinned.extend, supervisor, max_in_flight=max_in_flight,  # type: ignore[arg-type]
        delay_s=delay_s, busy=busy, max_defer_s=max_defer_s,
    )  # fmt: skip
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


async def test_failed_blocks_are_counted_logged_once_and_sent_again(caplog: pytest.LogCaptureFixture) -> None:
    async with write_behind(0) as (wb, store, unpinned):
        store.failing = {"b", "c"}
        with caplog.at_level(logging.WARNING, logger="yutu.worker.write_behind"):
            wb.offer([("a", 1), ("b", 2), ("c", 3)])
            assert await wb.flush(5.0)
        assert sorted(unpinned) == [1, 2, 3]  # failed blocks are unpinned too
        assert (wb.stats.written, wb.stats.failed) == (1, 2)
        [line] = [r.getMessage() for r in caplog.records]  # one line for the batch, not one a block
        assert line == "write-behind of 2 of 3 KV blocks failed; block b: writing 'b' failed"
        store.failing = set()
        wb.offer([("b", 4), ("a", 5)])  # a failed block is not remembered as stored: sent again
        assert await wb.flush(5.0)
        assert store.puts[-1][1] == ["b"] and wb.stats.written == 2 and wb.stats.known == 1


async def test_no_delay_writes_at_once() -> None:
    async with write_behind(0) as (wb, store, unpinned):
        wb.offer([("a", 1)])
        assert await wb.flush(5.0)
        assert [keys for _, keys, _ in store.puts] == [["a"]] and unpinned == [1]


async def test_writes_wait_while_the_instance_prefills() -> None:
    prefilling = [True]
    async with write_behind(0.01, busy=lambda: prefilling[0], max_defer_s=5.0) as (wb, store, unpinned):
        wb.offer([("a", 1)])
        await asyncio.sleep(0.15)
        wb.offer([("b", 2)])  # offered while deferred: joins the same put
        await asyncio.sleep(0.05)
        assert store.puts == [] and unpinned == []  # still prefilling: nothing written
        done_at = time.monotonic()
        prefilling[0] = False
        assert await wb.flush(5.0)
        [(put_at, keys, _)] = store.puts
        assert keys == ["a", "b"] and sorted(unpinned) == [1, 2]
        assert put_at - done_at < 0.5  # written once the prompts are done (polled every few ms)
        assert wb.stats.deferred_s > 0.1


async def test_a_deferred_write_goes_after_max_defer_s() -> None:
    async with write_behind(0, busy=lambda: True, max_defer_s=0.1) as (wb, store, unpinned):
        offered_at = time.monotonic()
        wb.offer([("a", 1)])
        assert await wb.flush(5.0)
        [(put_at, keys, _)] = store.puts
        assert keys == ["a"] and unpinned == [1]
        assert 0.09 <= put_at - offered_at < 1.0


async def test_a_deferred_write_goes_once_half_the_budget_waits() -> None:
    async with write_behind(0, busy=lambda: True, max_defer_s=30.0, max_in_flight=4) as (wb, store, unpinned):
        wb.offer([("a", 1)])  # 1 of 4 waiting: deferred
        await asyncio.sleep(0.05)
        assert store.puts == []
        wb.offer([("b", 2)])  # 2 of 4: half the budget; written without waiting for the prompts
        assert await wb.flush(5.0)
        assert [keys for _, keys, _ in store.puts] == [["a", "b"]] and sorted(unpinned) == [1, 2]
        assert wb.stats.skipped == 0
