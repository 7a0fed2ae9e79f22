"""Settling the effects of the master's state operations: Redis persistence, KV events and
disk-tier tasks.

A handler runs a synchronous state operation, then ``await settler.settle()``: what the operation
changed is marked for Redis and committed, its KV events are published, its disk-tier tasks go to
their nodes' queues. When there is nothing to wait for, ``settle`` finishes without suspending, so
a handler that only reads or only allocates replies in the same step (see
:mod:`services.store_master.eager`).

What waits for Redis: every acknowledged change that must survive a master restart -- put_end,
revoke, remove, mounts -- is committed before its reply. A put_start's allocation is committed in
the background instead (``settle(durable=False)``), within ``BACKGROUND_COMMIT_DELAY_S``: the put
is not acknowledged until put_end, whose commit writes the object's current record anyway. If the
master dies before that background write, the restarted master does not know the put, the writer's
put_end is refused with NOT_FOUND ("put the object again") and the space counts as free; a
restored pending put whose write did land is reclaimed after ``put_timeout_s`` as before.
"""

from __future__ import annotations

from yutu.rpc import KVEventPublisher

from services.store_master.objects import NodeTask
from services.store_master.persistence import Persister
from services.store_master.state import MasterState
from services.store_master.tasks import TaskDispatcher

# A put_start's record is written this long after it unless its put_end (whose commit writes the
# record's then-current value) comes first: one Redis write per put instead of two.
BACKGROUND_COMMIT_DELAY_S = 0.05


class Settler:
    """Takes the state's effects and carries them out (see the module docstring).

    ``persister`` None: metadata is not persisted (``--no-persist``); ``events`` None: no KV events.
    """

    def __init__(
        self,
        state: MasterState,
        persister: Persister | None,
        events: KVEventPublisher | None,
        tasks: TaskDispatcher,
    ) -> None:
        self.state = state
        self.persister = persister
        self.events = events
        self.tasks = tasks

    async def settle(self, durable: bool = True) -> list[NodeTask]:
        """Carry out the effects of the operations run so far; returns the disk-tier tasks they
        made. ``durable=False``: metadata-only effects are written to Redis in the background."""
        effects = self.state.take_effects()
        persister = self.persister
        if persister is not None and (effects.dirty_objects or effects.dirty_segments):
            persister.mark(effects.dirty_objects, effects.dirty_segments)
            if durable or effects.events or effects.tasks or effects.failed_tasks:
                await persister.commit()
            else:
                persister.commit_soon(BACKGROUND_COMMIT_DELAY_S)
        if self.events is not None and effects.events:
            await self.events.publish(effects.events)
        if effects.tasks:
            self.tasks.enqueue(effects.tasks)
        for task_id in effects.failed_tasks:
            self.tasks.finish(task_id, "the node holding the segment was lost")
        return effects.tasks
