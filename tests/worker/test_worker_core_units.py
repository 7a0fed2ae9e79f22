"""Control logic of the worker core, without processes: block runs, holds and their leases."""

from __future__ import annotations

import pytest
from yutu.worker.holds import Holds
from yutu.worker.kv_io import BlockRun, block_runs


def test_block_runs_merge_blocks_adjacent_on_both_sides() -> None:
    pairs = [(7, 3), (8, 4), (9, 5), (2, 9), (3, 11), (4, 12)]
    assert block_runs(pairs) == [
        BlockRun(local_start=7, remote_start=3, count=3, first_pair=0),
        BlockRun(local_start=2, remote_start=9, count=1, first_pair=3),  # remote 9 -> 11 is a gap
        BlockRun(local_start=3, remote_start=11, count=2, first_pair=4),
    ]
    assert block_runs([]) == []
    assert block_runs([(5, 5), (4, 6)]) == [BlockRun(5, 5, 1, 0), BlockRun(4, 6, 1, 1)]  # local goes back


def test_holds_release_once_by_decode_lease_or_shutdown() -> None:
    released: list[str] = []
    holds = Holds(lease_s=30.0, on_release=released.append)
    holds.add("a", [1, 2], 20, now=100.0)
    holds.add("b", [3], 5, now=101.0)
    holds.add("c", [4, 5, 6], 40, now=102.0)
    assert len(holds) == 3 and holds.held_blocks == 6 and "a" in holds
    with pytest.raises(ValueError, match="already holds"):
        holds.add("a", [9], 1, now=103.0)
    assert holds.release("a") and not holds.release("a")  # second release: nothing held
    assert holds.renew("b", now=125.0)  # b now expires at 155
    assert not holds.renew("zz", now=125.0)
    assert holds.expire(now=131.0) == []  # a released, b renewed, c ends at 132
    assert holds.expire(now=132.0) == ["c"]
    assert holds.expire(now=154.9) == []
    assert holds.expire(now=155.0) == ["b"]
    assert released == ["a", "c", "b"]
    assert (holds.released, holds.expired, len(holds)) == (1, 2, 0)
    holds.add("d", [7], 16, now=200.0)
    assert holds.next_deadline() == 230.0
    assert holds.release_all() == 1 and released[-1] == "d" and holds.next_deadline() is None


def test_holds_reject_a_non_positive_lease() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Holds(0, lambda _: None)
