"""Making room: run an allocation, and when no segment has space, evict, wait and try again.

Eviction frees DRAM at once (removed victims), or once a disk-tier offload finishes (victims
moving to disk), or once a lease ends (everything left is leased): :class:`Room` waits for
whichever applies, up to a bounded number of rounds, and answers OVERLOADED when nothing can be
freed -- everything is leased past the lease TTL, pinned or being written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from yutu.errors import ErrorKind, YutuError

from services.store_master.settle import Settler
from services.store_master.state import MasterState, NoSpaceError
from services.store_master.tasks import TaskDispatcher

T = TypeVar("T")


class Room:
    def __init__(self, state: MasterState, settler: Settler, tasks: TaskDispatcher) -> None:
        self.state = state
        self.settler = settler
        self.tasks = tasks

    async def make(self, attempt: Callable[[], T], size: int) -> T:
        """``attempt()`` (a state operation that raises :class:`NoSpaceError` when full), retried
        after evicting about ``eviction_ratio`` of the capacity (at least ``size`` bytes)."""
        policy = self.state.policy
        for _ in range(int(1 / policy.eviction_ratio) + 2):
            try:
                return attempt()
            except NoSpaceError:
                pass
            target = max(int(self.state.segments.capacity * policy.eviction_ratio), size)
            victims = self.state.evict(target)
            tasks = await self.settler.settle()
            if victims or self.state.disk.offloads_running():
                waits = [t.task_id for t in tasks if t.op == "offload"] or self.state.disk.offloads_running()
                await self.tasks.wait(waits)
                continue
            soon = self.state.next_release_at()
            if soon is None or soon - self.state.clock() > policy.lease_ttl_s:
                raise YutuError(
                    f"the store is full: no room for {size} bytes and every object is leased, pinned or "
                    "being written; retry later or add store nodes",
                    ErrorKind.OVERLOADED,
                )
            await asyncio.sleep(max(0.0, soon - self.state.clock()) + 0.01)  # a lease ends: wait
            self.state.sweep()
        raise YutuError(f"could not make room for {size} bytes; retry later", ErrorKind.OVERLOADED)
