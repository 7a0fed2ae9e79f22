"""Settling the effects of the master's state operations: Redis persistence, KV events and
disk-tier tasks.

Each handler runs the synchronous state operation, then settles its effects: they are marked for
Redis, committed, and its KV events published; disk-tier tasks go to their node's queue. Settling
returns None when nothing is left to wait for, so a handler can reply directly (the fast paths of
:mod:`services.store_master.service`).

What waits for Redis: every acknowledged change that must survive a master restart -- put_end,
revoke, remove, mounts -- is committed before its reply. A put_start's allocation is committed in
the background instead, within ``BACKGROUND_COMMIT_DELAY_S`` (its reply does not wait): the put is
not acknowledged until put_end, whose commit writes the object's current record anyway. If the master dies before that background write,
the restarted master does not know the put, the writer's put_end is refused with NOT_FOUND ("put
the object again") and the space counts as free; a restored pending put whose write did land is
reclaimed after ``put_timeout_s`` as before.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgpack
from yutu.errors import YutuError
from yutu.rpc import KVEventPublisher

from services.store_master.objects import NodeTask
from services.store_master.persistence import Persister
from services.store_master.settings import MasterSettings
from services.store_master.state import Effects, MasterState
from services.store_master.tasks import TaskDispatcher

T = TypeVar("T")

# A put_start's record is written this long after it unless its put_end (whose commit writes the
# record's then-current value) comes first: one Redis write per put instead of two.
BACKGROUND_COMMIT_DELAY_S = 0.05


class EffectSettling:
    """Mixin of :class:`~services.store_master.service.StoreMasterService`: settles what the state
    operations run so far mean for Redis, KV event subscribers and store nodes."""

    settings: MasterSettings
    state: MasterState
    tasks: TaskDispatcher
    _persister: Persister | None
    _events: KVEventPublisher | None

    def _settle_fast(self, durable: bool = True) -> Coroutine[Any, Any, Any] | None:
        """Settle the effects so far; None when nothing is left to wait for, else a coroutine to await.

        ``durable=False``: metadata-only effects are written to Redis in the background.
        """
        effects = self.state.take_effects()
        if effects.events or effects.tasks or effects.failed_tasks:
            return self._settle_effects(effects)
        if self.settings.persist and (effects.dirty_objects or effects.dirty_segments):
            assert self._persister is not None
            self._persister.mark(effects.dirty_objects, effects.dirty_segments)
            if durable:
                return self._persister.commit()
            self._persister.commit_soon(BACKGROUND_COMMIT_DELAY_S)
        return None

    def _then(self, pending: Coroutine[Any, Any, Any] | None, reply: T) -> T | Coroutine[Any, Any, T]:
        """``reply`` once ``pending`` (if any) is done."""
        if pending is None:
            return reply

        async def later() -> T:
            await pending
            return reply

        return later()

    def _settled(self, run: Callable[[], Any], durable: bool = True) -> Any:
        """Run a state operation (it returns a reply or an awaitable of it), then settle its effects;
        the reply, or an awaitable of it when something must be waited for."""
        try:
            reply = run()
        except YutuError as exc:
            pending = self._settle_fast(durable)
            if pending is None:
                raise
            return self._raise_after(pending, exc)
        if inspect.isawaitable(reply):
            return self._settle_after(reply)
        return self._then(self._settle_fast(durable), reply)

    @staticmethod
    async def _raise_after(pending: Coroutine[Any, Any, Any], exc: YutuError) -> Any:
        await pending
        raise exc

    async def _settle_after(self, reply: Awaitable[T]) -> T:
        try:
            return await reply
        finally:
            await self._settle()

    async def _settle(self) -> list[NodeTask]:
        """Apply the effects of the operations run so far; returns the disk-tier tasks they made."""
        return await self._settle_effects(self.state.take_effects())

    async def _settle_effects(self, effects: Effects) -> list[NodeTask]:
        assert self._persister is not None
        if self.settings.persist and (effects.dirty_objects or effects.dirty_segments):
            self._persister.mark(effects.dirty_objects, effects.dirty_segments)
            await self._persister.commit()
        if self._events is not None and effects.events:
            await self._events.publish(effects.events)
        self.tasks.enqueue(effects.tasks)
        for task_id in effects.failed_tasks:
            self.tasks.finish(task_id, "the node holding the segment was lost")
        return effects.tasks

    def _snapshot_object(self, key: str) -> bytes | None:
        entry = self.state.objects.get(key)
        return None if entry is None else msgpack.packb(entry.to_wire(), use_bin_type=True)

    def _snapshot_segment(self, name: str) -> bytes | None:
        segment = self.state.segments.get(name)
        return None if segment is None else msgpack.packb(segment.to_wire(), use_bin_type=True)
