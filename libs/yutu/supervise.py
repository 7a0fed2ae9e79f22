"""Background loops that cannot die silently.

Every long-running task of a service (a registry watch, a heartbeat, an event consumer, a
persistence loop) is started or watched through one :class:`Supervisor`. The loops themselves
survive bad data and transient errors (they catch, log what they skipped and go on); the
supervisor is the backstop for what they did not expect: a loop that ends with an exception is
logged with its traceback and recorded as a *problem*, and a service with a problem is not ready
(``/ready`` answers 503 and names it) instead of quietly degrading.

A loop that returns normally, or is cancelled, is not a problem: that is how loops are stopped.
Most loops are "do this every N seconds": :meth:`Supervisor.every` runs one, surviving any error
of a single step (logged with its traceback; the next step runs on time). Loops are stopped with
:func:`cancel_and_wait`, which survives a cancellation that got lost on the way.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

log = logging.getLogger(__name__)

RECANCEL_S = 0.1  # a task still running this long after a cancel is cancelled again
STOP_PATIENCE_S = 5.0  # cancel_and_wait gives up (logs, returns) after this long


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], owner: str, patience_s: float = STOP_PATIENCE_S
) -> None:
    """Cancel ``tasks`` and wait until every one has ended; what they raised is retrieved, not raised.

    A cancellation can be lost: on Python 3.11 ``asyncio.wait_for`` returns the awaited result
    instead of raising CancelledError when both land in one loop iteration (CPython gh-86296,
    fixed in 3.12), and redis-py's connect path awaits one. A loop whose cancel was swallowed
    that way runs on, and a plain ``cancel(); await gather(...)`` then waits forever (a gateway's
    shutdown hung so in CI). So a task still running :data:`RECANCEL_S` after a cancel is
    cancelled again; one still running after ``patience_s`` is logged as an error and left.
    """
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    done: set[asyncio.Task[Any]] = set()
    while pending:
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.error(
                "%s: %d task(s) did not stop within %.1f s of being cancelled, left running: %s",
                owner, len(pending), patience_s, ", ".join(sorted(t.get_name() for t in pending)),
            )  # fmt: skip
            break
        for task in pending:
            task.cancel()
        ended, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, remaining))
        done |= ended
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at garbage collection


class Supervisor:
    """The background tasks of one service and the reasons any of them died."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.problems: dict[str, str] = {}  # task name -> why it died (only the loops that did)
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._periodic: set[str] = set()  # the names of the loops started by every()

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as the task ``name`` and watch it."""
        task = asyncio.create_task(coro, name=name)
        self.watch(name, task)
        return task

    def every(
        self, name: str, interval_s: float, step: Callable[[], Awaitable[object] | None]
    ) -> asyncio.Task[Any]:
        """Run ``step()`` (sync, or async and awaited) every ``interval_s`` seconds as the task ``name``.

        The first step runs one interval after the call. A step that raises is logged with its
        traceback and the loop goes on: one bad record or a transient error never ends it. A step
        that expects an error (Redis down) should catch it and log it briefly itself.
        """
        if interval_s <= 0:
            raise ValueError(f"{self.owner}: {name} needs a positive interval, got {interval_s}")
        task = self.spawn(name, self._every(name, interval_s, step))
        self._periodic.add(name)
        return task

    async def _every(
        self, name: str, interval_s: float, step: Callable[[], Awaitable[object] | None]
    ) -> None:
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(interval_s)
            try:
                result = step()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - logged; the loop must outlive one bad step
                log.exception("%s: a step of %s failed (the loop goes on)", self.owner, name)
            if task is not None and task.cancelling():
                # Cancelled during the step, and something in it swallowed the CancelledError
                # (redis-py's asyncio client can): stop anyway, or close() would wait forever.
                raise asyncio.CancelledError

    def watch(self, name: str, task: asyncio.Task[Any]) -> None:
        """Watch a task someone else created (a library object's loop)."""
        if name in self._tasks and not self._tasks[name].done():
            raise ValueError(f"{self.owner}: a task named {name!r} is already supervised")
        self._tasks[name] = task
        self._periodic.discard(name)
        self.problems.pop(name, None)
        task.add_done_callback(lambda t: self._ended(name, t))

    def _ended(self, name: str, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        self.problems[name] = f"{name} died: {type(exc).__name__}: {exc}"
        log.error(
            "%s: background task %s died; the service is no longer ready",
            self.owner,
            name,
            exc_info=exc,
        )

    @property
    def tasks(self) -> dict[str, asyncio.Task[Any]]:
        return dict(self._tasks)

    async def stop_periodic(self) -> None:
        """Stop the loops started by :meth:`every` (the first step of a shutdown: no periodic step
        may run on a socket or client the shutdown already closed); the other tasks run on."""
        await cancel_and_wait([self._tasks[name] for name in self._periodic], self.owner)

    async def close(self) -> None:
        """Cancel every task still running and wait for them (see :func:`cancel_and_wait`)."""
        await cancel_and_wait(self._tasks.values(), self.owner)
