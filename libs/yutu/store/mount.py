"""Keeping a segment mounted on the store master: mount, heartbeat, remount, unmount.

Used by store nodes and by clients that contribute their own memory. The heartbeat lists the
segment with its incarnation; when the master answers that it does not know it (it lost it, or a
restarted master never had it), the segment is mounted again. A master that cannot be reached is
retried every interval; it drops the segment's replicas once the node TTL passes without a beat.
Finding the master goes through the registry, so a Redis outage is one more reason a beat or the
final unmount fails: logged, retried (the beat) or given up (the unmount), never raised.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from yutu.errors import YutuError
from yutu.protocol import store as p
from yutu.store.master import MasterClient
from yutu.supervise import cancel_and_wait
from yutu.transfer.segment import local_host_id

log = logging.getLogger(__name__)

UNREACHABLE = (YutuError, RedisError, OSError)  # the master, or the registry that names it, is not there


class MountedSegment:
    def __init__(
        self,
        master: MasterClient,
        node_id: str,
        segment: str,
        region: str,
        size: int,
        incarnation: int,
        disk_capacity: int = 0,
        interval_s: float = 1.0,
    ) -> None:
        self.master = master
        self.node_id = node_id
        self.segment = segment
        self._mount_msg = p.MountSegment(
            node_id, segment, region, size, local_host_id(), incarnation, disk_capacity
        )
        self.incarnation = incarnation
        self.interval_s = interval_s
        self.mounted = False
        self._task: asyncio.Task[None] | None = None

    async def mount(self) -> None:
        await self.master.call(self._mount_msg)
        if not self.mounted:
            log.info("segment %s mounted on the store master at %s", self.segment, self.master.endpoint)
        self.mounted = True

    def start(self) -> asyncio.Task[None]:
        """Mount (retrying until the master answers) and heartbeat in the background; returns the
        task so that the owner can supervise it (it only ends when cancelled by :meth:`close`)."""
        self._task = asyncio.create_task(self._run(), name=f"store-heartbeat-{self.segment}")
        return self._task

    async def _run(self) -> None:
        beat = p.Heartbeat(self.node_id, [p.MountedSegment(self.segment, self.incarnation)])
        while True:
            try:
                if not self.mounted:
                    await self.mount()
                reply = await self.master.call(beat, max(2.0, self.interval_s))
                if self.segment in reply.remount:
                    log.warning("the store master does not know segment %s: mounting it again", self.segment)
                    self.mounted = False
                    await self.mount()
            except UNREACHABLE as exc:
                log.warning("store master heartbeat for %s failed (%s); retrying", self.segment, exc)
            await asyncio.sleep(self.interval_s)

    async def close(self, unmount: bool = True) -> None:
        """Stop heartbeating; ``unmount`` tells the master (its objects on this segment are dropped).

        Never raises because the master or Redis is gone: the master then drops the segment
        after its node TTL, as for a node that died."""
        if self._task is not None:
            await cancel_and_wait([self._task], f"store heartbeat of {self.segment}")
            self._task = None
        if unmount and self.mounted:
            try:
                await self.master.call(p.UnmountSegment(self.node_id, self.segment), 2.0)
            except UNREACHABLE as exc:
                log.warning(
                    "could not unmount %s (the master drops it after its node TTL): %s", self.segment, exc
                )
        self.mounted = False
