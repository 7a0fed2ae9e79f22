"""The disk tier: evicted objects move to a store node's disk directory and come back on read.

The master decides, the node copies. Each move is a :class:`NodeTask` handed to the node that owns
the segment (it long-polls ``FetchTasks``) and finished by its ``TasksDone``::

    offload  node copies region[offset : offset + length] to a file; then the object's DRAM
             replicas are released and one DISK replica on that segment replaces them
    promote  master allocates DRAM on the segment, node copies the file there and deletes it;
             the DISK replica becomes a DRAM replica
    drop     node deletes the file (removed, replaced or pushed out of a full disk)

While a task runs the object is ``busy`` (eviction skips it). A full disk makes room by dropping
the objects that have been on it longest and are not protected. Only :class:`MasterState` calls this.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from yutu.errors import ErrorKind, YutuError
from yutu.protocol.kv_events import BlockRemoved, key_to_hash
from yutu.store.types import Medium, ReplicaState

from services.store_master.objects import NodeTask, ObjectEntry, Replica

if TYPE_CHECKING:
    from services.store_master.state_core import StateCore


@dataclass
class _Running:
    task: NodeTask
    orphaned: bool = False  # the object was removed while the task ran


class DiskTier:
    def __init__(self, state: StateCore) -> None:
        self.state = state
        self.running: dict[str, _Running] = {}

    def _new_task(self, op: str, segment: str, key: str, offset: int | None, length: int) -> NodeTask:
        seg = self.state.segments.get(segment)
        assert seg is not None
        task = NodeTask(secrets.token_hex(8), seg.node_id, op, segment, key, offset, length)
        if op != "drop":
            self.running[task.task_id] = _Running(task)
        self.state.effects.tasks.append(task)
        return task

    # -- offload (eviction to disk) --------------------------------------------------------------

    def start_offload(self, entry: ObjectEntry) -> bool:
        """Begin moving an eviction victim to a disk tier; False if no node of it has room."""
        for replica in entry.dram_replicas():
            segment = self.state.segments.get(replica.segment)
            if segment is None or segment.disk_capacity < replica.length:
                continue
            if not self._make_room(segment.name, replica.length):
                continue
            segment.disk_used += replica.length  # reserved now so two offloads cannot overfill it
            entry.busy = "offloading"
            self._new_task("offload", segment.name, entry.key, replica.offset, replica.length)
            return True
        return False

    def _make_room(self, segment_name: str, length: int) -> bool:
        segment = self.state.segments.get(segment_name)
        assert segment is not None
        now = self.state.clock()
        for key in list(segment.disk_keys):
            if segment.disk_used + length <= segment.disk_capacity:
                break
            entry = self.state.objects[key]
            if entry.protection(now) is None and not entry.dram_replicas():
                self.state.remove_entry(entry, publish=False)
                self.state.effects.events.append(BlockRemoved([key_to_hash(key)]))
        return segment.disk_used + length <= segment.disk_capacity

    def offload_done(self, running: _Running, error: str | None) -> None:
        task = running.task
        segment = self.state.segments.get(task.segment)
        entry = self.state.objects.get(task.key)
        if running.orphaned or entry is None or segment is None:
            if segment is not None:
                segment.disk_used -= task.length
                if error is None:
                    self._new_task("drop", task.segment, task.key, None, task.length)
            return
        entry.busy = None
        if error is not None:  # could not write the file: evict the plain way
            segment.disk_used -= task.length
            self.state.remove_entry(entry)
            return
        for replica in entry.dram_replicas():
            self.state.release(entry, replica)
        disk = Replica(task.segment, None, task.length, ReplicaState.COMPLETE, Medium.DISK)
        entry.replicas = (*entry.disk_replicas(), disk)
        self.state.eviction.gone(task.key)
        segment.disk_keys[task.key] = None
        self.state.counters.offloaded_objects += 1
        self.state.effects.dirty_objects.add(task.key)

    # -- promote (read of an object only on disk) ------------------------------------------------

    def start_promote(self, key: str) -> str:
        """The id of the task bringing ``key`` back to DRAM (an existing one if already running).

        Raises ``NoSpaceError`` when its segment has no room (the caller evicts and retries).
        """
        for running in self.running.values():
            if running.task.key == key and running.task.op == "promote" and not running.orphaned:
                return running.task.task_id
        entry = self.state.objects.get(key)
        if entry is None or not entry.disk_replicas():
            raise YutuError(f"object {key!r} not found in the store", ErrorKind.NOT_FOUND)
        replica = entry.disk_replicas()[0]
        offset = self.state.segments.allocate_on(replica.segment, replica.length)
        if offset is None:
            from services.store_master.state_core import NoSpaceError

            raise NoSpaceError(
                f"no DRAM free on {replica.segment} to bring {key!r} back from disk; retry shortly"
            )
        entry.busy = "promoting"
        return self._new_task("promote", replica.segment, key, offset, replica.length).task_id

    def promote_done(self, running: _Running, error: str | None) -> None:
        task = running.task
        assert task.offset is not None
        entry = self.state.objects.get(task.key)
        segment = self.state.segments.get(task.segment)
        if segment is None:
            return
        if running.orphaned or entry is None or error is not None:
            self.state.segments.free(task.segment, task.offset)
            if entry is not None and not running.orphaned:
                entry.busy = None
            return
        entry.busy = None
        kept = (r for r in entry.replicas if not (r.medium is Medium.DISK and r.segment == task.segment))
        entry.replicas = (*kept, Replica(task.segment, task.offset, task.length, ReplicaState.COMPLETE))
        self.state.eviction.stored(entry)
        segment.disk_used -= task.length
        segment.disk_keys.pop(task.key, None)
        self.state.counters.promoted_objects += 1
        self.state.effects.dirty_objects.add(task.key)

    # -- completion, removal, failures -----------------------------------------------------------

    def task_done(self, task_id: str, error: str | None) -> bool:
        """Record a node's result; False for an unknown (already failed) task."""
        running = self.running.pop(task_id, None)
        if running is None:
            return False
        if running.task.op == "offload":
            self.offload_done(running, error)
        else:
            self.promote_done(running, error)
        return True

    def drop_file(self, key: str, replica: Replica) -> None:
        segment = self.state.segments.get(replica.segment)
        if segment is None:
            return
        segment.disk_used -= replica.length
        segment.disk_keys.pop(key, None)
        self._new_task("drop", segment.name, key, None, replica.length)

    def forget(self, entry: ObjectEntry) -> None:
        """``entry`` is being removed: running tasks for it clean up after themselves."""
        for running in self.running.values():
            if running.task.key == entry.key:
                running.orphaned = True

    def segment_dropped(self, name: str) -> None:
        for task_id in [t for t, r in self.running.items() if r.task.segment == name]:
            running = self.running.pop(task_id)
            entry = self.state.objects.get(running.task.key)
            if entry is not None and not running.orphaned:
                entry.busy = None
            self.state.effects.failed_tasks.append(task_id)

    def offloads_running(self) -> list[str]:
        """Ids of the offloads a node is still copying (room they will free once done)."""
        return [t for t, r in self.running.items() if r.task.op == "offload"]

    def restore(self, key: str, replica: Replica) -> None:
        segment = self.state.segments.get(replica.segment)
        assert segment is not None
        segment.disk_used += replica.length
        segment.disk_keys[key] = None

    def add_expected_allocations(self, expected: dict[str, int]) -> None:
        for running in self.running.values():
            if running.task.op == "promote":
                expected[running.task.segment] = expected.get(running.task.segment, 0) + 1
