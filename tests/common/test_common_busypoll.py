"""yutu.busypoll: polling for a reply keeps the event loop serving other tasks, stops when the
reply is there, and never outlasts its budget by sleeping."""

from __future__ import annotations

import asyncio
import time

from yutu.busypoll import poll_until


async def test_polling_yields_to_other_tasks_and_stops_when_done() -> None:
    ticks = 0
    done = False

    async def other() -> None:
        nonlocal ticks, done
        for _ in range(50):
            ticks += 1
            await asyncio.sleep(0)
        done = True

    task = asyncio.ensure_future(other())
    await poll_until(lambda: done, budget_s=60.0)  # would spin a minute if it stopped serving `other`
    assert done and ticks == 50
    await task


async def test_polling_gives_up_after_its_budget() -> None:
    start = time.perf_counter()
    await poll_until(lambda: False, budget_s=0.02)
    assert time.perf_counter() - start >= 0.02


async def test_a_zero_budget_does_not_yield() -> None:
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    task = asyncio.ensure_future(other())
    await poll_until(lambda: False, budget_s=0.0)
    assert not ran  # returned without giving the loop a turn: the plain path
    await task
    assert ran
