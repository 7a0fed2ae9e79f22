"""The supervisor of background loops: dead loops become problems, cancelled loops stop."""

from __future__ import annotations

import asyncio
import random

import pytest
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.supervise import Supervisor, cancel_and_wait


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


async def test_cancel_and_wait_cancels_again_when_a_cancellation_is_lost() -> None:
    """A task that swallows its first cancel and runs on (a lost cancellation) still ends."""
    swallowed = asyncio.Event()

    async def swallows_once() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # lost, as in Python 3.11's asyncio.wait_for (gh-86296)
        await asyncio.sleep(3600)  # the loop goes on to its next sleep

    task = asyncio.create_task(swallows_once())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task], "test"), 5)
    assert swallowed.is_set() and task.cancelled()


async def test_cancel_and_wait_gives_up_on_a_task_that_never_stops(caplog: pytest.LogCaptureFixture) -> None:
    stop = asyncio.Event()

    async def refuses() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(refuses(), name="stubborn")
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task], "svc", patience_s=0.3), 5)
    assert not task.done()
    assert (
        "svc: 1 task(s) did not stop within 0.3 s of being cancelled, left running: stubborn" in caplog.text
    )
    stop.set()
    task.cancel()
    await task


async def test_cancel_and_wait_retrieves_what_the_tasks_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait([task], "test")  # does not raise
    assert isinstance(task.exception(), RuntimeError)


async def test_a_registration_closes_whenever_it_is_closed(redis_url: str, registry_prefix: str) -> None:
    """Closed at random moments of its heartbeat against the real Redis, close() always returns.

    redis-py's reconnect path (after a cancelled command dropped the connection) awaits Python
    3.11's ``asyncio.wait_for``, which can lose a cancellation; a plain cancel-and-gather then
    waited forever (a gateway test hung for its whole 300 s timeout in CI).
    """
    registry = Registry.from_url(redis_url, registry_prefix)
    rng = random.Random(0)
    try:
        for i in range(60):  # ~1 in 5 closes loses its first cancel here
            record = ServiceRecord("worker", f"w{i}", {"generate": "tcp://127.0.0.1:1"}, {})
            registration = Registration(registry, record, ttl_s=0.003)  # ~1 ms sleeps: mostly in Redis
            await registration.start()
            await asyncio.sleep(rng.random() * 0.003)
            await asyncio.wait_for(registration.close(), 10)
            assert registration.task is not None and registration.task.done()
        assert await registry.list("worker") == []
    finally:
        await registry.close()


async def test_stop_periodic_stops_the_every_loops_and_leaves_the_other_tasks() -> None:
    sup = Supervisor("svc")
    ticked = asyncio.Event()
    periodic = sup.every("poll", 0.001, ticked.set)
    reader = sup.spawn("reader", asyncio.sleep(3600))
    await asyncio.wait_for(ticked.wait(), 10)
    await sup.stop_periodic()
    assert periodic.cancelled() and not reader.done()
    await sup.close()
    assert reader.cancelled() and not sup.problems
