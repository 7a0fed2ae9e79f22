"""The core of the master's metadata: its policy, data, effects and counters, and how an object's
space is given back (removal and retirement).

:class:`StateCore` owns the tables every part of :class:`~services.store_master.state.MasterState`
works on; the parts (membership, puts, the evictor, the disk tier) are given it. Space that a reader may still be
copying (leased replicas) or a writer may still be filling (a removed put) is not freed at once but
*retired* until the lease or the put deadline has passed; the sweep frees it.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from yutu.errors import ErrorKind, YutuError
from yutu.evict import POLICIES
from yutu.protocol.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    extend_joined,
    key_to_hash,
)
from yutu.store.types import Medium

from services.store_master.disk_tier import DiskTier
from services.store_master.eviction_order import EvictionOrder
from services.store_master.objects import NodeTask, ObjectEntry, PendingPut, Replica
from services.store_master.segments import SegmentTable


class NoSpaceError(YutuError):
    """No segment can hold the object right now; the caller may evict and retry."""

    kind = ErrorKind.OVERLOADED


@dataclass(frozen=True)
class StatePolicy:
    lease_ttl_s: float = 5.0  # a read lease keeps replicas from eviction and freeing this long
    soft_pin_ttl_s: float = 1800.0  # a soft-pinned object is not evicted for this long after a put/read
    put_timeout_s: float = 30.0  # a put not ended by then is reclaimed (its writer is presumed gone)
    node_ttl_s: float = 10.0  # a segment whose node is silent this long is dropped
    high_watermark: float = 0.90  # evict when used / capacity passes this
    eviction_ratio: float = 0.05  # evict about this fraction of the capacity per round
    alignment: int = 64  # allocation granularity inside segments
    block_size: int = 16  # tokens per block, published in BlockStored events
    eviction_policy: str = "lru"  # which yutu.evict policy orders the victims

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "soft_pin_ttl_s", "put_timeout_s", "node_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"high watermark must be in (0, 1], got {self.high_watermark}")
        if not 0.0 < self.eviction_ratio <= 1.0:
            raise ValueError(f"eviction ratio must be in (0, 1], got {self.eviction_ratio}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"--eviction-policy must be one of {', '.join(POLICIES)}, got {self.eviction_policy!r}"
            )


@dataclass
class Effects:
    dirty_objects: set[str] = field(default_factory=set)
    dirty_segments: set[str] = field(default_factory=set)
    events: list[KVEvent] = field(default_factory=list)
    tasks: list[NodeTask] = field(default_factory=list)
    failed_tasks: list[str] = field(default_factory=list)  # task ids that can no longer finish

    def __bool__(self) -> bool:
        return bool(
            self.dirty_objects or self.dirty_segments or self.events or self.tasks or self.failed_tasks
        )

    def stored(self, block_hash: BlockHash, block_size: int) -> None:
        """A new readable object's ``BlockStored``, joining the last event when that one is a
        ``BlockStored`` too (:func:`~yutu.protocol.kv_events.extend_joined`). Its hashes are a set
        of objects, not a chain of blocks (no parent hash)."""
        extend_joined(self.events, [BlockStored([block_hash], block_size=block_size)])


@dataclass
class Counters:
    evicted_objects: int = 0
    evicted_bytes: int = 0
    eviction_rounds: int = 0
    reclaimed_puts: int = 0
    lost_objects: int = 0  # removed because every replica's node died
    offloaded_objects: int = 0
    promoted_objects: int = 0


def bad_request(message: str) -> YutuError:
    return YutuError(message, ErrorKind.INVALID_REQUEST)


def check_int(name: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise bad_request(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class StateCore:
    """The master's tables (segments, objects, reservations, eviction order, retired extents, disk tier) and the
    effects and counters its operations leave; only the state's own operations mutate them."""

    def __init__(self, policy: StatePolicy, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self.clock = clock
        self.segments = SegmentTable(policy.alignment)
        self.objects: dict[str, ObjectEntry] = {}
        self.reserved: dict[str, PendingPut] = {}  # put_id -> a reservation (see services.store_master.puts)
        self.eviction = EvictionOrder(policy.eviction_policy, policy.alignment)  # objects holding DRAM
        self.retired: list[tuple[float, str, int]] = []  # (free at, segment, offset)
        self.disk = DiskTier(self)
        self.counters = Counters()
        self.effects = Effects()
        # put ids: a random prefix per master process and a serial, unique across restarts and
        # cheaper than drawing 8 random bytes per put
        self.put_prefix = secrets.token_hex(4) + "-"
        self.put_serial = itertools.count(1)

    def take_effects(self) -> Effects:
        effects, self.effects = self.effects, Effects()
        return effects

    # -- removal ---------------------------------------------------------------------------------

    def remove(self, key: str) -> bool:
        """Remove ``key`` (and any put in progress for it); False if it was not there."""
        entry = self.objects.get(key) if isinstance(key, str) else None
        if entry is None:
            return False
        self.remove_entry(entry)
        return True

    def remove_all(self) -> int:
        """Remove every object (one AllBlocksCleared event); returns how many there were."""
        count = len(self.objects)
        for entry in list(self.objects.values()):
            self.remove_entry(entry, publish=False)
        self.effects.events.append(AllBlocksCleared())
        return count

    def remove_entry(self, entry: ObjectEntry, publish: bool = True) -> None:
        """Forget ``entry``: its space is given back (see :meth:`release`; a put in progress is
        retired until its deadline) and, when it was readable and ``publish``, BlockRemoved goes out."""
        now = self.clock()
        for replica in entry.replicas:
            self.release(entry, replica)
        if entry.pending is not None:  # the writer may still be copying: free after its deadline
            deadline = max(entry.pending.started_at + self.policy.put_timeout_s, now)
            for replica in entry.pending.replicas:
                assert replica.offset is not None
                self.retired.append((deadline, replica.segment, replica.offset))
        if entry.readable and publish:
            self.effects.events.append(BlockRemoved([key_to_hash(entry.key)]))
        self.disk.forget(entry)
        del self.objects[entry.key]
        self.eviction.gone(entry.key)
        self.effects.dirty_objects.add(entry.key)

    def release(self, entry: ObjectEntry, replica: Replica) -> None:
        """Give a replica's space back: DRAM at once or when the lease ends; DISK via the node."""
        if replica.medium is Medium.DISK:
            self.disk.drop_file(entry.key, replica)
            return
        assert replica.offset is not None
        if self.clock() < entry.lease_until:
            self.retired.append((entry.lease_until, replica.segment, replica.offset))
        else:
            self.segments.free(replica.segment, replica.offset)
