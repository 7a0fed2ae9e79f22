"""Adaptive (ARC-like): exact eviction orders, ghost hits moving the split, protection honoured."""

from __future__ import annotations

import pytest
from yutu.evict import make_policy
from yutu.evict.adaptive import Adaptive


def evict(policy: Adaptive, need: int) -> list[str]:
    """What a cache does: ask for victims, then remove each."""
    victims = policy.victims(need)
    for key in victims:
        policy.remove(key)
    return victims


def test_new_keys_go_first_while_the_target_is_zero() -> None:
    arc = make_policy("adaptive", 4)
    assert isinstance(arc, Adaptive)
    for key in ["a", "b", "c", "d"]:
        arc.insert(key)
    arc.access("a")
    arc.access("b")
    arc.access("a")  # T1 = [c, d]; T2 = b (2), a (3)
    assert arc.victims(4) == ["c", "d", "b", "a"]
    assert (len(arc), arc.used) == (4, 4)


def test_ghost_hit_in_the_recency_part_grows_its_target() -> None:
    arc = Adaptive(4)
    for key in ["a", "b", "c", "d"]:
        arc.insert(key)
    arc.access("a")
    arc.access("b")  # T1 = [c, d], T2 = [a, b]
    assert evict(arc, 1) == ["c"]  # T1 holds 2 > target 0
    arc.insert("e")
    assert evict(arc, 1) == ["d"]
    assert arc.recent_ghosts.keys() == ["c", "d"]
    arc.insert("c")  # a B1 ghost: T1 was too small -> target += 1 * max(1, 0 // 2)
    assert arc.target == 1 and arc.frequent.count_of("c") == 2
    assert arc.recent_ghosts.keys() == ["d"]
    # T1 = [e] (1, not above target 1) -> T2 first: a, b, c (count 2 each, in arrival order), then e
    assert arc.victims(4) == ["a", "b", "c", "e"]


def test_ghost_hit_in_the_frequency_part_shrinks_the_target() -> None:
    arc = Adaptive(4)
    arc.target = 3
    for key in ["a", "b", "c"]:
        arc.insert(key)
    arc.access("a")
    arc.access("a")  # T2 = a (3); T1 = [b, c] (2, not above 3)
    assert evict(arc, 1) == ["a"]
    assert arc.frequent_ghosts.keys() == ["a"]
    arc.insert("a")  # a B2 ghost: target -= 1 * max(1, 0 // 1); its count comes back + 1
    assert arc.target == 2 and arc.frequent.count_of("a") == 4
    arc.insert("d")  # T1 = [b, c, d]: 3 > 2 -> b first; then T1 holds 2, not above 2 -> a (T2)
    assert arc.victims(2) == ["b", "a"]
    assert arc.victims(4) == ["b", "a", "c", "d"]  # T2 has nothing left -> T1


def test_deletes_leave_no_ghost_and_ghost_lists_are_bounded() -> None:
    arc = Adaptive(2)
    for key in ["a", "b", "c", "d"]:
        arc.insert(key)
    arc.remove("a")  # a delete (never proposed): no ghost
    assert evict(arc, 3) == ["b", "c", "d"]
    assert arc.recent_ghosts.keys() == ["c", "d"]  # at most capacity (2) units: b dropped
    arc.insert("a")
    assert arc.target == 0 and "a" in arc.recent  # not a ghost hit


def test_protected_keys_are_skipped_in_both_parts() -> None:
    arc = Adaptive(10)
    for key in ["a", "b", "c", "d"]:
        arc.insert(key)
    arc.access("c")
    arc.access("d")  # T1 = [a, b], T2 = [c, d]
    leased = {"a", "c"}
    assert arc.victims(2, lambda k: k in leased) == ["b", "d"]
    assert arc.victims(9, lambda k: k in leased) == ["b", "d"]
    assert arc.victims(9, lambda k: True) == []
    arc.access("d")  # used since it was proposed: its remove is a delete
    arc.remove("b")  # proposed (by an earlier answer too): an eviction, a ghost
    arc.remove("d")
    assert arc.recent_ghosts.keys() == ["b"] and arc.frequent_ghosts.keys() == []


def test_sizes_and_errors() -> None:
    arc = Adaptive(10)
    arc.insert("a", 3)
    arc.insert("b", 4)
    arc.insert("a", 5)  # resident: an access with the new size -> T2
    assert arc.used == 9 and arc.frequent.size_of("a") == 5
    assert arc.victims(5) == ["b", "a"]
    with pytest.raises(KeyError):
        arc.access("zzz")
    with pytest.raises(ValueError, match="positive"):
        Adaptive(0)


def test_resize_caps_the_target_and_trims_the_ghosts() -> None:
    arc = Adaptive(4)
    for key in ["a", "b", "c", "d"]:
        arc.insert(key)
    assert evict(arc, 3) == ["a", "b", "c"]
    arc.target = 4
    arc.resize(2)
    assert (arc.capacity, arc.target, arc.recent_ghosts.keys()) == (2, 2, ["b", "c"])
    with pytest.raises(ValueError, match="positive"):
        arc.resize(0)
