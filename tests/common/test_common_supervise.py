"""The supervisor of background loops: dead loops become problems, cancelled loops stop."""

from __future__ import annotations

import asyncio

import pytest
from yutu.supervise import Supervisor


async def test_a_loop_that_dies_is_a_problem_and_a_cancelled_one_is_not() -> None:
    sup = Supervisor("svc")

    async def dies() -> None:
        raise RuntimeError("boom")

    sup.spawn("dies", dies())
    sup.spawn("sleeps", asyncio.sleep(3600))
    await asyncio.sleep(0.01)
    assert sup.problems == {"dies": "dies died: RuntimeError: boom"}
    await sup.close()
    assert list(sup.problems) == ["dies"]


async def test_a_periodic_loop_outlives_a_bad_step() -> None:
    sup = Supervisor("svc")
    calls: list[int] = []

    def step() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise ValueError("one bad record")

    sup.every("loop", 0.001, step)
    for _ in range(1000):
        if len(calls) >= 3:
            break
        await asyncio.sleep(0.005)
    assert len(calls) >= 3 and not sup.problems
    await sup.close()


async def test_a_periodic_loop_stops_when_a_step_swallows_its_cancellation() -> None:
    """A library that catches CancelledError inside a step must not keep the loop (and close()) alive."""
    sup = Supervisor("svc")
    in_step = asyncio.Event()

    async def swallowing_step() -> None:
        in_step.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # what a misbehaving client library does

    task = sup.every("loop", 0.001, swallowing_step)
    await in_step.wait()
    await asyncio.wait_for(sup.close(), 5)  # returns: the loop honoured the cancel after the step
    assert task.cancelled() and not sup.problems


async def test_every_needs_a_positive_interval() -> None:
    with pytest.raises(ValueError, match="positive interval"):
        Supervisor("svc").every("loop", 0, lambda: None)
