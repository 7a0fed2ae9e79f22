"""Trace parsing and the block caches (yutu.evict policies) the instances and the store use."""

from __future__ import annotations

from pathlib import Path

import pytest
from yutu.sim.cache import BlockCache
from yutu.sim.trace import TraceError, block_key, load_trace

from tests.sim.sim_support import write_trace


def test_trace_lines_become_requests_with_full_block_keys(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [(3000, 9, 2, [7, 8, 9]), (1000, 8, 1, [7, 5])])
    first, second = load_trace(path, time_scale=2.0, block_size=4)
    assert (first.index, first.arrival_s, first.block_keys) == (1, 0.5, (block_key(7), block_key(5)))
    assert (second.index, second.arrival_s) == (0, 1.5)  # sorted by arrival
    assert second.block_keys == (block_key(7), block_key(8))  # the partial block 9 has no key
    assert block_key(255) == "000000000000000000000000000000ff"  # the conductor's format of a KV-event hash
    assert [r.index for r in load_trace(path, block_size=4, limit=1)] == [0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{nope", "t.jsonl:2: not JSON"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp must be"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length must be"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids must be"),
    ],
)
def test_bad_trace_lines_name_their_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\n' + line + "\n"
    )
    with pytest.raises(TraceError, match=message):
        load_trace(path)
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        load_trace(path, time_scale=0)


def test_lru_cache_evicts_the_oldest_but_never_the_chain_it_admits() -> None:
    cache = BlockCache("lru", 4)
    assert cache.admit(["a", "b", "c"]) == 3
    cache.touch(["a"])  # a is now the most recent: b goes first
    assert cache.admit(["x", "y"]) == 2
    assert sorted(cache.keys()) == ["a", "c", "x", "y"] and cache.evictions == 1
    assert cache.prefix_hits(["a", "c", "b"]) == 2 and cache.prefix_hits(["a", "c"], limit=1) == 1
    # A chain longer than the cache: its head goes in, the tail stays out, none of it is evicted.
    assert cache.admit(["p", "q", "r", "s", "t"]) == 4
    assert sorted(cache.keys()) == ["p", "q", "r", "s"]


def test_lfu_keeps_the_hot_block_and_unlimited_keeps_all() -> None:
    cache = BlockCache("lfu", 2)
    cache.admit(["hot"])
    for _ in range(3):
        cache.admit(["hot"])  # re-admitting a resident key is a hit
    cache.admit(["cold1"])
    cache.admit(["cold2"])
    assert "hot" in cache and "cold2" in cache and "cold1" not in cache
    unlimited = BlockCache("lru", None)
    assert unlimited.admit([str(i) for i in range(10_000)]) == 10_000 and len(unlimited) == 10_000
    none = BlockCache("lru", 0)  # no store at all
    assert none.admit(["a", "b"]) == 0 and "a" not in none and len(none) == 0
    with pytest.raises(ValueError, match="capacity must be an integer >= 0 blocks"):
        BlockCache("lru", -1)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        BlockCache("fifo", 3)
