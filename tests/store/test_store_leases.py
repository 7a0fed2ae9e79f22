"""LeaseCache: what a client may reuse, and for how long (pure control logic)."""

from yutu.store.leases import LeaseCache
from yutu.store.types import Medium, ReplicaDescriptor, ReplicaState

REPLICA = ReplicaDescriptor("seg-a", "segment", 4096, 100, ReplicaState.COMPLETE, "host-1", Medium.DRAM)


def test_an_entry_is_usable_until_margin_before_the_lease_ends() -> None:
    cache = LeaseCache(margin_s=1.0)
    cache.remember("k", (100, [REPLICA]), asked_at=10.0, lease_ttl_s=5.0)  # usable until 14.0
    assert cache.get("k", 10.5) == (100, [REPLICA])
    assert cache.get("k", 13.99) == (100, [REPLICA])
    assert cache.get("k", 14.0) is None
    assert cache.get("other", 10.5) is None


def test_a_lease_no_longer_than_the_margin_is_not_kept() -> None:
    cache = LeaseCache(margin_s=1.0)
    cache.remember("k", (100, [REPLICA]), asked_at=10.0, lease_ttl_s=1.0)
    assert len(cache) == 0
    assert cache.get("k", 10.0) is None


def test_forget_and_clear_drop_entries() -> None:
    cache = LeaseCache(margin_s=0.0)
    for key in ("a", "b", "c"):
        cache.remember(key, (1, [REPLICA]), asked_at=0.0, lease_ttl_s=5.0)
    cache.forget(["a", "missing"])
    assert [cache.get(k, 1.0) is not None for k in ("a", "b", "c")] == [False, True, True]
    cache.clear()
    assert len(cache) == 0


def test_prune_drops_only_expired_entries_and_only_past_the_bound() -> None:
    cache = LeaseCache(margin_s=0.0)
    cache.remember("old", (1, [REPLICA]), asked_at=0.0, lease_ttl_s=1.0)  # until 1.0
    cache.remember("new", (1, [REPLICA]), asked_at=0.0, lease_ttl_s=10.0)  # until 10.0
    cache.prune(now=5.0, keep=2)  # not over the bound: nothing dropped
    assert len(cache) == 2
    cache.prune(now=5.0, keep=1)
    assert len(cache) == 1
    assert cache.get("new", 5.0) == (1, [REPLICA])
