"""Settling the effects of the master's state operations: Redis persistence, KV events and
disk-tier tasks.

A handler runs a synchronous state operation, then ``await settler.settle(...)``: what the
operation changed is marked for Redis and committed, its KV events are published, its disk-tier
tasks go to their nodes' queues. When there is nothing to wait for, ``settle`` finishes without
suspending, so a handler that only reads or only allocates replies in the same step (see
:mod:`services.store_master.eager`).

How durable, per operation (:class:`Durability`):

- ``NOW``: committed to Redis before the reply -- revoke, remove, mounts, and every operation
  that gives space back or makes disk-tier tasks (an upsert's put_end, evictions). Space that a
  record in Redis still names is never handed to another object before that record is gone, so
  a master that crashes and recovers from Redis never serves an object whose bytes were
  overwritten.
- ``BEHIND``: a put_end that made a new object readable and released nothing. Its record is
  written within ``WRITE_BEHIND_S`` and its KV event published within ``EVENTS_BEHIND_S`` (one
  Redis write for every put finished in the first window, one event batch for those of the second)
  instead of before the reply: the put costs no Redis round trip, and the master's CPU, the
  bottleneck of a stream of small puts, is not spent once per put on them. A graceful stop writes
  what is pending (``Persister.close``), and any ``NOW`` operation's commit writes it too. What it
  relaxes: if the master process *crashes* (SIGKILL, power), the puts acknowledged in its last
  ``WRITE_BEHIND_S`` are not known after the restart -- a get answers NOT_FOUND and the space counts
  as free, as for an object that was evicted: this is a cache, the writer puts it again on its next
  miss. Such a lost put is never served wrong: the restarted master has no record of it at all.
  Redis itself, with ``appendfsync everysec``, may lose up to a second of writes on a crash of its
  own, so the window is well inside what the deployment can lose anyway; each write takes the
  master's loop for a while and wakes Redis on a core a put may be waiting for (a 64 KiB put that
  starts then takes 3-4x its median), so fewer, larger writes keep a stream of puts' tail down:
  with 20 ms, one put in ~70 of the bench's back-to-back stream met a write, one in ~350 with
  100 ms.
- ``SOON``: a put_start's allocation, committed in the background within
  ``BACKGROUND_COMMIT_DELAY_S`` unless its put_end (whose commit writes the record's current value)
  comes first. If the master dies before that write, the restarted master does not know the put,
  the writer's put_end is refused with NOT_FOUND ("put the object again") and the space counts as
  free; a restored pending put whose write did land is reclaimed after ``put_timeout_s``. A
  put_start that evicted (KV events) or made tasks is committed ``NOW``.
"""

from __future__ import annotations

import asyncio
import enum

from yutu.protocol.kv_events import KVEvent, extend_joined
from yutu.rpc import KVEventPublisher

from services.store_master.eager import run_eager
from services.store_master.objects import NodeTask
from services.store_master.persistence import Persister
from services.store_master.state import MasterState
from services.store_master.tasks import TaskDispatcher

# A put_start's record is written this long after it unless its put_end (whose commit writes the
# record's then-current value) comes first: one Redis write per put instead of two.
BACKGROUND_COMMIT_DELAY_S = 0.05
# The most a BEHIND put_end's record lags its reply (the bound on what a master crash can lose).
WRITE_BEHIND_S = 0.1
# The most a BEHIND put_end's KV event lags its reply (how stale the conductor's view of the pool is).
EVENTS_BEHIND_S = 0.02


class Durability(enum.Enum):
    """When an operation's metadata reaches Redis (see the module docstring)."""

    NOW = "now"  # before the reply
    BEHIND = "behind"  # within WRITE_BEHIND_S, events within EVENTS_BEHIND_S (put_end that released nothing)
    SOON = "soon"  # within BACKGROUND_COMMIT_DELAY_S unless it evicted or made tasks (put_start)


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
        self._behind: list[KVEvent] = []  # events of BEHIND operations, published within EVENTS_BEHIND_S
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    async def settle(self, durability: Durability = Durability.NOW) -> list[NodeTask]:
        """Carry out the effects of the operations run so far; returns the disk-tier tasks they
        made. Tasks (and tasks that failed) always commit ``NOW``."""
        effects = self.state.take_effects()
        behind = durability is Durability.BEHIND and not (effects.tasks or effects.failed_tasks)
        persister = self.persister
        if persister is not None and (effects.dirty_objects or effects.dirty_segments):
            persister.mark(effects.dirty_objects, effects.dirty_segments)
            if behind:
                persister.commit_soon(WRITE_BEHIND_S)
            elif durability is Durability.SOON and not (
                effects.events or effects.tasks or effects.failed_tasks
            ):
                persister.commit_soon(BACKGROUND_COMMIT_DELAY_S)
            else:
                await persister.commit()
        if self.events is not None and effects.events:
            if behind:  # one batch (one BlockStored) for every put_end of the window, not one each
                extend_joined(self._behind, effects.events)
                if self._flush_timer is None:
                    self._flush_timer = asyncio.get_running_loop().call_later(
                        EVENTS_BEHIND_S, self.flush_events
                    )
            else:  # after what is still held, so events keep their order
                events, self._behind = self._behind + effects.events, []
                await self.events.publish(events)
        if effects.tasks:
            self.tasks.enqueue(effects.tasks)
        for task_id in effects.failed_tasks:
            self.tasks.finish(task_id, "the node holding the segment was lost")
        return effects.tasks

    def flush_events(self) -> None:
        """Publish the held events of BEHIND operations now, in order (also at shutdown)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self.events is None or not self._behind:
            return
        events, self._behind = self._behind, []
        pending = run_eager(self.events.publish(events))  # in place: nothing published meanwhile
        if pending is not None:  # it waits (the publisher's lock): the rest runs as a task
            task = asyncio.ensure_future(pending)
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def close(self) -> None:
        """Publish what is held and wait for publications in flight."""
        self.flush_events()
        await asyncio.gather(*self._flushes, return_exceptions=True)
