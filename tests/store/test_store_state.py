"""The master's metadata logic, driven directly with a fake clock: exact offsets, replica placement,
leases, pins, eviction order, liveness, put timeouts, recovery and malformed input."""

from __future__ import annotations

import msgpack
import pytest
from yutu.errors import ErrorKind, YutuError
from yutu.protocol.kv_events import BlockRemoved, BlockStored
from yutu.store.types import Medium, ReplicaState

from services.store_master.objects import ObjectEntry, Segment
from services.store_master.state import MasterState, NoSpaceError, StatePolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


POLICY = StatePolicy(
    lease_ttl_s=5.0,
    soft_pin_ttl_s=60.0,
    put_timeout_s=10.0,
    node_ttl_s=1e6,
    high_watermark=0.9,
    eviction_ratio=0.05,
)


def make(segments: int = 2, size: int = 4096, policy: StatePolicy = POLICY) -> tuple[MasterState, Clock]:
    clock = Clock()
    st = MasterState(policy, clock)
    for i in range(segments):
        st.mount(f"node{i}", f"seg{i}", "dram", size, "host-a", incarnation=1)
    st.take_effects()
    return st, clock


def put(st: MasterState, key: str, size: int, **kw: object) -> list[tuple[str, int | None]]:
    put_id, replicas = st.put_start(key, size, **kw)  # type: ignore[arg-type]
    assert put_id is not None
    st.put_end(key, put_id)
    return [(r.segment, r.offset) for r in replicas]


def test_put_places_replicas_on_distinct_segments_with_exact_offsets() -> None:
    st, _ = make()
    put_id, replicas = st.put_start("a", 100, replicas=2)
    assert put_id is not None
    assert [(r.segment, r.offset, r.length, r.state) for r in replicas] == [
        ("seg0", 0, 100, ReplicaState.WRITING),
        ("seg1", 0, 100, ReplicaState.WRITING),
    ]
    assert not st.exists("a")  # invisible until put_end
    with pytest.raises(YutuError) as err:
        st.get_replicas("a")
    assert err.value.kind is ErrorKind.NOT_FOUND
    st.put_end("a", put_id)
    assert st.exists("a")
    found = st.get_replicas("a")
    assert found is not None
    size, got = found
    assert size == 100 and [(r.segment, r.offset, r.state) for r in got] == [
        ("seg0", 0, ReplicaState.COMPLETE),
        ("seg1", 0, ReplicaState.COMPLETE),
    ]
    # next object goes to the segment with the most free bytes, ties by name
    assert put(st, "b", 64) == [("seg0", 128)]
    assert put(st, "c", 64) == [("seg1", 128)]
    assert put(st, "d", 10, replicas=5) == [("seg0", 192), ("seg1", 192)]  # best effort: 2 segments
    effects = st.take_effects()
    assert effects.dirty_objects == {"a", "b", "c", "d"}
    # "a" is not hex (odd length): published as its UTF-8 bytes; puts ended one after another
    # make one event
    assert [e.block_hashes for e in effects.events if isinstance(e, BlockStored)] == [
        [b"a", b"b", b"c", b"d"]
    ]
    st.check()


def test_stored_events_of_consecutive_puts_share_one_event_in_order() -> None:
    st, _ = make(segments=1)
    put(st, "a", 100)
    put(st, "b", 100)
    assert st.remove("a")
    put(st, "c", 100)
    put(st, "b", 100, upsert=True)  # b was readable already: stored again, no new event
    events = st.take_effects().events
    assert events == [
        BlockStored([b"a", b"b"], block_size=POLICY.block_size),
        BlockRemoved([b"a"]),
        BlockStored([b"c"], block_size=POLICY.block_size),
    ]
    put(st, "d", 100)  # a new batch of effects starts a new event
    assert st.take_effects().events == [BlockStored([b"d"], block_size=POLICY.block_size)]


def test_put_of_existing_key_is_idempotent_and_upsert_replaces() -> None:
    st, clock = make(segments=1)
    assert put(st, "k", 100) == [("seg0", 0)]
    assert st.put_start("k", 100) == (None, ())  # already stored: nothing to write
    put_id, replicas = st.put_start("k", 300, upsert=True)
    assert put_id is not None and [(r.offset, r.length) for r in replicas] == [(128, 300)]
    found = st.get_replicas("k")  # still the old bytes while the upsert is written; takes a lease
    assert found is not None and found[0] == 100 and found[1][0].offset == 0
    st.put_end("k", put_id)
    found = st.get_replicas("k")
    assert found is not None and found[0] == 300 and found[1][0].offset == 128
    # the old extent was leased: retired until the lease ends, then freed by the sweep
    assert st.retired == [(1005.0, "seg0", 0)]
    assert st.segments.allocators["seg0"].used_bytes == 128 + 320
    clock.now += 5.0
    st.sweep()
    assert st.retired == []
    assert st.segments.allocators["seg0"].free_ranges() == [(0, 128), (448, 4096 - 448)]
    st.check()


def test_put_end_and_revoke_need_the_right_put_id() -> None:
    st, _ = make(segments=1)
    put_id, _ = st.put_start("k", 64)
    with pytest.raises(YutuError) as err:
        st.put_end("k", "not-the-id")
    assert err.value.kind is ErrorKind.NOT_FOUND and "put the object again" in str(err.value)
    assert put_id is not None
    st.put_revoke("k", put_id)
    assert "k" not in st.objects
    assert st.segments.used_bytes == 0
    with pytest.raises(YutuError):
        st.put_end("k", put_id)
    st.check()


def test_eviction_is_lru_and_skips_leased_writing_and_pinned() -> None:
    st, clock = make(segments=1, size=1024)  # 16 slots of 64 bytes
    for key in ["k0", "k1", "k2", "k3", "k4", "k5"]:
        put(st, key, 64)
        clock.now += 1
    put(st, "pinned", 64, soft_pin=True)
    assert st.get_replicas("k0") is not None  # k0 leased and now most recently used
    writing_id, _ = st.put_start("writing", 64)
    clock.now += 1
    # LRU order: k1 k2 k3 k4 k5 pinned k0 ; "writing" is not readable yet
    assert st.eviction.policy.victims(10_000) == ["k1", "k2", "k3", "k4", "k5", "pinned", "k0"]
    assert st.evict(target_bytes=128) == ["k1", "k2"]
    assert st.evict(target_bytes=10_000) == ["k3", "k4", "k5"]  # pinned, leased k0 and writing stay
    effects = st.take_effects()
    removed = [e.block_hashes for e in effects.events if isinstance(e, BlockRemoved)]
    assert removed == [[b"k1", b"k2"], [b"k3", b"k4", b"k5"]]
    clock.now += 5  # the lease on k0 ends
    assert st.evict(target_bytes=10_000) == ["k0"]
    clock.now += 60  # the soft pin runs out
    assert st.evict(target_bytes=10_000) == ["pinned"]
    assert writing_id is not None and set(st.objects) == {"writing"}
    st.check()


def test_reads_refresh_the_soft_pin() -> None:
    st, clock = make(segments=1)
    put(st, "p", 64, soft_pin=True)
    clock.now += 50
    st.get_replicas("p")
    clock.now += 50  # 100 s after the put, 50 s after the read: still pinned (TTL 60)
    assert st.objects["p"].protection(clock.now) == "pinned"
    clock.now += 11
    assert st.objects["p"].protection(clock.now) is None


def test_watermark_and_allocation_failure() -> None:
    st, clock = make(segments=1, size=1024)
    for i in range(14):  # 14 * 64 = 896 bytes = 87.5%
        put(st, f"k{i:02d}", 64)
        clock.now += 1
    assert not st.over_watermark()
    put(st, "k14", 64)  # 93.75%
    assert st.over_watermark()
    st.sweep()  # evicts 5% of 1024 = 51 bytes -> one 64-byte object, the oldest
    assert "k00" not in st.objects and st.counters.evicted_objects == 1
    put(st, "k15", 64)
    put(st, "k16", 64)
    with pytest.raises(NoSpaceError):
        st.put_start("big", 256)
    assert st.evict(256) == ["k01", "k02", "k03", "k04"]
    assert put(st, "big", 256) == [("seg0", 64)]  # k01..k04 were contiguous at [64, 320)
    st.check()


def test_too_large_and_no_segments() -> None:
    st, _ = make(segments=1, size=1024)
    with pytest.raises(YutuError) as err:
        st.put_start("huge", 2048)
    assert err.value.kind is ErrorKind.TOO_LARGE
    empty = MasterState(POLICY, Clock())
    with pytest.raises(YutuError) as err:
        empty.put_start("k", 10)
    assert err.value.kind is ErrorKind.UNAVAILABLE


@pytest.mark.parametrize(
    ("key", "size", "replicas"),
    [
        (None, 10, 1),
        ("", 10, 1),
        ("x" * 513, 10, 1),
        (b"bytes", 10, 1),
        ("k", 0, 1),
        ("k", -5, 1),
        ("k", "9", 1),
        ("k", 10, 0),
        ("k", 1.5, 1),
        ("k", True, 1),
    ],
)
def test_malformed_put_start_is_refused_and_changes_nothing(
    key: object, size: object, replicas: object
) -> None:
    st, _ = make()
    with pytest.raises(YutuError) as err:
        st.put_start(key, size, replicas)  # type: ignore[arg-type]
    assert err.value.kind is ErrorKind.INVALID_REQUEST
    assert st.objects == {} and st.segments.used_bytes == 0 and not st.take_effects()


def test_malformed_mount_is_refused() -> None:
    st, _ = make(segments=0)
    for args in [
        ("n", "s", "r", 0, "h", 1),
        ("n", "", "r", 10, "h", 1),
        ("n", "s", "r", 10, "h", -1),
        (1, "s", "r", 10, "h", 1),
    ]:
        with pytest.raises(YutuError) as err:
            st.mount(*args)  # type: ignore[arg-type]
        assert err.value.kind is ErrorKind.INVALID_REQUEST
    assert len(st.segments) == 0


def test_silent_node_loses_its_replicas_other_copies_survive() -> None:
    st, clock = make(segments=2, policy=StatePolicy(node_ttl_s=3.0))
    put(st, "both", 64, replicas=2)
    assert put(st, "only1", 64) == [("seg0", 64)]  # equal free bytes: by name
    st.take_effects()
    clock.now += 2
    assert st.heartbeat("node1", [("seg1", 1)]) == []
    assert st.heartbeat("node1", [("seg9", 1)]) == ["seg9"]  # unknown: remount it
    clock.now += 2  # seg0 silent for 4 s > TTL 3 s
    st.sweep()
    assert "seg0" not in st.segments and "seg1" in st.segments
    found = st.get_replicas("both")
    assert found is not None and [r.segment for r in found[1]] == ["seg1"]
    assert not st.exists("only1")
    effects = st.take_effects()
    assert [e.block_hashes for e in effects.events if isinstance(e, BlockRemoved)] == [[b"only1"]]
    assert effects.dirty_segments == {"seg0"}
    st.check()


def test_remount_with_new_incarnation_drops_old_replicas() -> None:
    st, _ = make(segments=1)
    put(st, "k", 64)
    assert not st.mount("node0", "seg0", "dram", 4096, "host-a", incarnation=1)  # same: no-op
    assert st.exists("k")
    assert st.mount("node0", "seg0", "dram", 4096, "host-a", incarnation=2)
    assert not st.exists("k") and st.segments.used_bytes == 0
    st.check()


def test_abandoned_put_is_reclaimed_after_the_timeout() -> None:
    st, clock = make(segments=1)
    st.put_start("k", 64)
    clock.now += 9
    st.sweep()
    assert "k" in st.objects
    clock.now += 2
    st.sweep()
    assert "k" not in st.objects and st.segments.used_bytes == 0 and st.counters.reclaimed_puts == 1


def test_remove_of_a_leased_or_writing_object_frees_space_later() -> None:
    st, clock = make(segments=1)
    put(st, "r", 64)
    st.get_replicas("r")
    pid, _ = st.put_start("w", 64)
    assert st.remove("r") and st.remove("w") and not st.remove("nope")
    assert st.retired == [(1005.0, "seg0", 0), (1010.0, "seg0", 64)]
    assert pid is not None
    with pytest.raises(YutuError):
        st.put_end("w", pid)
    clock.now += 10
    st.sweep()
    assert st.segments.used_bytes == 0
    st.check()


def test_metadata_round_trips_and_restores_exact_allocations() -> None:
    st, clock = make(segments=2)
    put(st, "a", 100, replicas=2)
    put(st, "b", 700)
    pending_id, _ = st.put_start("c", 64)
    st.remove("a")  # retired state is not persisted: its space is free after a restart
    put(st, "a", 30)
    segments = [
        Segment.from_wire(n, msgpack.unpackb(msgpack.packb(s.to_wire())))
        for n, s in st.segments.segments.items()
    ]
    objects = [
        ObjectEntry.from_wire(k, msgpack.unpackb(msgpack.packb(e.to_wire()), raw=False))
        for k, e in st.objects.items()
    ]
    fresh = MasterState(POLICY, clock)
    fresh.restore(segments + [], objects)
    for name in ("seg0", "seg1"):
        assert fresh.segments.allocators[name].free_ranges() != []
    assert {k: [(r.segment, r.offset) for r in e.replicas] for k, e in fresh.objects.items()} == {
        k: [(r.segment, r.offset) for r in e.replicas] for k, e in st.objects.items()
    }
    assert fresh.objects["c"].pending is not None and fresh.objects["c"].pending.put_id == pending_id
    fresh.put_end("c", pending_id)  # the writer can still finish after a master restart
    fresh.check()
    # replicas on segments that did not come back are dropped
    lonely = MasterState(POLICY, clock)
    lonely.restore([s for s in segments if s.name == "seg0"], objects)
    assert all(r.segment == "seg0" for e in lonely.objects.values() for r in e.replicas)
    lonely.check()


def test_disk_tier_offload_then_promote() -> None:
    clock = Clock()
    st = MasterState(POLICY, clock)
    st.mount("node0", "seg0", "dram", 1024, "h", 1, disk_capacity=4096)
    put(st, "cold", 256)
    clock.now += 1
    put(st, "warm", 256)
    st.take_effects()
    assert st.evict(target_bytes=1) == ["cold"]
    effects = st.take_effects()
    assert [(t.op, t.key, t.offset, t.length) for t in effects.tasks] == [("offload", "cold", 0, 256)]
    assert st.objects["cold"].protection(clock.now) == "offloading"
    assert st.segments.segments["seg0"].disk_used == 256
    st.disk.task_done(effects.tasks[0].task_id, None)
    cold = st.objects["cold"]
    assert [(r.medium, r.offset) for r in cold.replicas] == [(Medium.DISK, None)]
    assert st.segments.used_bytes == 256  # only "warm" in DRAM
    assert st.get_replicas("cold") is None  # on disk: must be promoted first
    task_id = st.disk.start_promote("cold")
    assert st.disk.start_promote("cold") == task_id  # concurrent readers share one promotion
    (task,) = st.take_effects().tasks
    assert (task.op, task.offset, task.length) == ("promote", 0, 256)
    st.check()
    st.disk.task_done(task_id, None)
    found = st.get_replicas("cold")
    assert found is not None and [(r.medium, r.offset) for r in found[1]] == [(Medium.DRAM, 0)]
    assert st.segments.segments["seg0"].disk_used == 0
    st.check()


def test_next_release_at_reports_when_leased_space_frees() -> None:
    st, clock = make(segments=1)
    assert st.next_release_at() is None
    put(st, "a", 64)
    put(st, "b", 64, soft_pin=True)
    st.get_replicas("b")  # pinned as well as leased: its lease ending frees nothing
    assert st.next_release_at() is None
    st.get_replicas("a")
    assert st.next_release_at() == clock.now + 5.0
    clock.now += 1
    assert st.remove("a")  # retired until the same instant
    assert st.retired == [(1005.0, "seg0", 0)] and st.next_release_at() == 1005.0


@pytest.mark.parametrize(
    ("name", "order"),
    [
        ("lru", ["e", "f", "a", "b", "c", "d"]),  # last use first: d came back last
        ("lfu", ["e", "f", "d", "b", "c", "a"]),  # uses: d, e, f 1 (d newest), b 2, c 3, a 4
        ("adaptive", ["e", "f", "b", "d", "c", "a"]),  # d's ghost hit grew the recency target to 64
    ],
)
def test_the_eviction_policy_orders_the_victims(name: str, order: list[str]) -> None:
    st, clock = make(segments=1, size=1024, policy=StatePolicy(soft_pin_ttl_s=60.0, eviction_policy=name))
    for key in ["a", "b", "c", "d", "e", "f"]:
        put(st, key, 64)
    put(st, "p", 64, soft_pin=True)  # pinned: never a victim
    for key in ["a", "a", "a", "b", "c", "c"]:
        assert st.get_replicas(key) is not None
    clock.now += 6  # the read leases end
    assert st.evict(target_bytes=64) == ["d"]
    put(st, "d", 64)
    assert st.evict(target_bytes=10_000) == order
    assert set(st.objects) == {"p"}
    st.check()


def test_an_unknown_eviction_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="--eviction-policy must be one of lru, lfu, adaptive"):
        StatePolicy(eviction_policy="fifo")
