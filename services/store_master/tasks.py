"""Hand-off of disk-tier tasks to store nodes (long poll) and waiting for their results.

The state decides what moves (:mod:`services.store_master.disk_tier`); this class queues each task
for its node, answers the node's ``FetchTasks`` long poll, and resolves a future per task when the
node reports it done (or when its node is lost) so a put or a read can wait for the move.
"""

from __future__ import annotations

import asyncio

from services.store_master.objects import NodeTask

TASK_WAIT_S = 30.0  # how long a put or a read waits for a disk-tier task
MAX_POLL_S = 60.0


class TaskDispatcher:
    def __init__(self) -> None:
        self._queues: dict[str, list[NodeTask]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._futures: dict[str, asyncio.Future[str | None]] = {}

    def enqueue(self, tasks: list[NodeTask]) -> None:
        for task in tasks:
            self._queues.setdefault(task.node_id, []).append(task)
            self._wakeup(task.node_id).set()
            if task.op != "drop":  # nobody waits for a file deletion
                self._futures[task.task_id] = asyncio.get_running_loop().create_future()

    def finish(self, task_id: str, error: str | None) -> None:
        """Record a task's end (``error`` None: success); wakes whoever waits for it."""
        future = self._futures.pop(task_id, None)
        if future is not None and not future.done():
            future.set_result(error)

    async def wait(self, task_ids: list[str]) -> None:
        futures = [self._futures[t] for t in task_ids if t in self._futures]
        if futures:
            await asyncio.wait(futures, timeout=TASK_WAIT_S)

    async def fetch(self, node_id: str, wait_s: float) -> list[NodeTask]:
        """The tasks queued for ``node_id``, waiting up to ``wait_s`` for the first one."""
        wakeup = self._wakeup(node_id)
        if not self._queues.get(node_id):
            try:
                await asyncio.wait_for(wakeup.wait(), max(0.0, min(wait_s, MAX_POLL_S)))
            except TimeoutError:
                pass
        wakeup.clear()
        return self._queues.pop(node_id, [])

    def close(self) -> None:
        for task_id in list(self._futures):
            self.finish(task_id, "the store master is shutting down")

    def _wakeup(self, node_id: str) -> asyncio.Event:
        return self._wakeups.setdefault(node_id, asyncio.Event())
