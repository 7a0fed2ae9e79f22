"""Background loops that cannot die silently.

Every long-running task of a service (a registry watch, a heartbeat, an event consumer, a
persistence loop) is started or watched through one :class:`Supervisor`. The loops themselves
survive bad data and transient errors (they catch, log what they skipped and go on); the
supervisor is the backstop for what they did not expect: a loop that ends with an exception is
logged with its traceback and recorded as a *problem*, and a service with a problem is not ready
(``/ready`` answers 503 and names it) instead of quietly degrading.

A loop that returns normally, or is cancelled, is not a problem: that is how loops are stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Supervisor:
    """The background tasks of one service and the reasons any of them died."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.problems: dict[str, str] = {}  # task name -> why it died (only the loops that did)
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as the task ``name`` and watch it."""
        task = asyncio.create_task(coro, name=name)
        self.watch(name, task)
        return task

    def watch(self, name: str, task: asyncio.Task[Any]) -> None:
        """Watch a task someone else created (a library object's loop)."""
        if name in self._tasks and not self._tasks[name].done():
            raise ValueError(f"{self.owner}: a task named {name!r} is already supervised")
        self._tasks[name] = task
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

    async def close(self) -> None:
        """Cancel every task still running and wait for them."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
