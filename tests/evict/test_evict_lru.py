"""LRU: exact eviction orders; protected keys (leased, pinned, being written) are skipped."""

from __future__ import annotations

import pytest
from yutu.evict import make_policy


def test_order_is_least_recently_inserted_or_accessed_first() -> None:
    lru = make_policy("lru", 100)
    for key in ["a", "b", "c", "d", "e"]:
        lru.insert(key)
    lru.access("b")
    lru.access("a")
    lru.insert("d")  # re-insert of a resident key is an access
    assert lru.victims(5) == ["c", "e", "b", "a", "d"]
    assert lru.victims(2) == ["c", "e"]
    assert (len(lru), lru.used) == (5, 5)  # victims() removes nothing


def test_sizes_sum_to_need_and_protected_keys_are_skipped() -> None:
    lru = make_policy("lru", 100)
    for key, size in [("a", 4), ("b", 1), ("c", 3), ("d", 2)]:
        lru.insert(key, size)
    assert lru.used == 10
    assert lru.victims(5) == ["a", "b"]  # 4 + 1 reaches 5
    assert lru.victims(6) == ["a", "b", "c"]
    leased = {"a", "c"}
    assert lru.victims(3, lambda k: k in leased) == ["b", "d"]
    assert lru.victims(99, lambda k: k in leased) == ["b", "d"]  # not enough unprotected: fewer
    assert lru.victims(99, lambda k: True) == []
    assert lru.victims(0) == [] and lru.victims(-3) == []


def test_remove_and_the_callers_evictions() -> None:
    lru = make_policy("lru", 100)
    for key in ["a", "b", "c"]:
        lru.insert(key)
    for key in lru.victims(2):
        lru.remove(key)
    assert "a" not in lru and "b" not in lru and "c" in lru
    lru.remove("zzz")  # unknown: no-op
    lru.insert("a", 7)  # back as a new key: youngest
    lru.insert("c", 2)  # re-insert with a new size: an access
    assert lru.victims(100) == ["a", "c"] and lru.used == 9
    with pytest.raises(KeyError):
        lru.access("b")


def test_bad_sizes_and_names_are_refused() -> None:
    lru = make_policy("lru", 10)
    with pytest.raises(ValueError, match="positive int"):
        lru.insert("a", 0)
    with pytest.raises(ValueError, match="lru, lfu, adaptive"):
        make_policy("fifo", 10)
    with pytest.raises(ValueError, match="positive int"):
        make_policy("lru", 0)
