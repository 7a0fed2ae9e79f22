"""LFU: exact eviction orders (fewest uses first; equal counts: the first to reach the count first)."""

from __future__ import annotations

import pytest
from yutu.evict import make_policy


def test_order_is_fewest_uses_first_ties_oldest_first() -> None:
    lfu = make_policy("lfu", 100)
    for key in ["a", "b", "c", "d", "e"]:
        lfu.insert(key)
    assert lfu.victims(5) == ["a", "b", "c", "d", "e"]  # all count 1: insertion order
    lfu.access("c")
    lfu.access("a")  # c and a now count 2; c got there first
    lfu.access("c")  # c: 3
    lfu.insert("e")  # re-insert = access: e 2, after a
    assert lfu.victims(5) == ["b", "d", "a", "e", "c"]
    assert lfu.victims(3) == ["b", "d", "a"]


def test_a_recent_newcomer_goes_before_an_old_frequent_key() -> None:
    lfu, lru = make_policy("lfu", 100), make_policy("lru", 100)
    for policy in (lfu, lru):
        policy.insert("old")
        for _ in range(3):
            policy.access("old")
        policy.insert("new")
    assert lfu.victims(1) == ["new"]
    assert lru.victims(1) == ["old"]


def test_sizes_protection_and_forgetting_on_remove() -> None:
    lfu = make_policy("lfu", 100)
    for key, size in [("a", 2), ("b", 5), ("c", 1)]:
        lfu.insert(key, size)
    lfu.access("a")
    lfu.access("a")
    assert lfu.victims(6) == ["b", "c"]
    pinned = {"b"}
    assert lfu.victims(2, lambda k: k in pinned) == ["c", "a"]
    lfu.remove("a")
    lfu.insert("a", 2)  # its count was forgotten: back to 1, youngest of count 1
    assert lfu.victims(100) == ["b", "c", "a"]
    assert (len(lfu), lfu.used) == (3, 8)
    lfu.remove("nope")
    with pytest.raises(KeyError):
        lfu.access("nope")
