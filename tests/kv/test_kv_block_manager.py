"""BlockManager: exact block ids, ref counts, prefix hits and eviction order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from yutu.kv.block_manager import BlockManager, OutOfBlocksError
from yutu.kv.hashing import block_key_digests, root_key

BS = 4
ROOT = root_key("test-model")


@dataclass
class FakeSeq:
    """A minimal sequence: tokens, computed counter and the chained keys of its full blocks."""

    seq_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_keys = block_key_digests(ROOT, self.tokens, BS)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.block_keys = block_key_digests(ROOT, self.tokens, BS)


@pytest.fixture
def bm() -> Iterator[BlockManager]:
    manager = BlockManager(num_blocks=8, block_size=BS)
    yield manager
    manager.check_integrity()


def run_prefill(bm: BlockManager, seq: FakeSeq) -> int:
    """Allocate and pretend the whole sequence got computed (as the engine does after a step)."""
    cached = bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    bm.check_integrity()
    return cached


def test_fresh_allocation_takes_lowest_ids(bm: BlockManager) -> None:
    seq = FakeSeq("a", list(range(10)))  # 3 blocks: 4 + 4 + 2
    assert bm.can_allocate(seq)
    assert bm.allocate(seq) == 0
    assert bm.block_table("a") == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert bm.free_queue() == [3, 4, 5, 6, 7]
    assert bm.num_cached_blocks == 0  # nothing computed yet
    bm.check_integrity()


def test_computed_full_blocks_get_registered(bm: BlockManager) -> None:
    seq = FakeSeq("a", list(range(10)))
    bm.allocate(seq)
    seq.num_computed_tokens = 6  # one chunk: block 0 full, block 1 half
    bm.cache_computed_blocks(seq)
    assert bm.block_key(0) == seq.block_keys[0]
    assert bm.block_key(1) is None
    seq.num_computed_tokens = 10
    bm.cache_computed_blocks(seq)
    assert bm.block_key(1) == seq.block_keys[1]
    assert bm.block_key(2) is None  # partial block never gets a key
    assert bm.num_cached_blocks == 2
    bm.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_tokens(bm: BlockManager) -> None:
    a = FakeSeq("a", list(range(10)))
    run_prefill(bm, a)
    b = FakeSeq("b", list(range(8)) + [100, 101, 102])  # shares blocks 0 and 1
    assert bm.allocate(b) == 8
    assert bm.block_table("b") == [0, 1, 3]
    assert [bm.ref_count(x) for x in range(4)] == [2, 2, 1, 1]
    assert bm.prefix_cache_queries_tokens == 10 + 11
    assert bm.prefix_cache_hit_tokens == 8
    bm.check_integrity()


def test_full_hit_leaves_last_block_to_compute(bm: BlockManager) -> None:
    a = FakeSeq("a", list(range(8)))  # exactly 2 full blocks
    assert run_prefill(bm, a) == 0
    assert bm.num_cached_blocks == 2
    b = FakeSeq("b", list(range(8)))
    assert bm.allocate(b) == 4  # block 1 holds the last token: recomputed in a new block
    assert bm.block_table("b") == [0, 2]
    b.num_computed_tokens = 8
    bm.cache_computed_blocks(b)
    assert bm.block_key(2) is None  # key already owned by block 1; ours stays unkeyed
    bm.check_integrity()


def test_free_orders_queue_tail_first_and_keeps_keys(bm: BlockManager) -> None:
    a = FakeSeq("a", list(range(10)))  # blocks 0,1 keyed; 2 partial
    run_prefill(bm, a)
    bm.free(a)
    # Unkeyed block 2 goes to the head; keyed blocks join the tail last-first: 1 then 0.
    assert bm.free_queue() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert [bm.ref_count(x) for x in range(3)] == [0, 0, 0]
    assert bm.num_cached_blocks == 2
    assert bm.usage == 0.0
    bm.check_integrity()
    # The cached blocks are found again after free.
    again = FakeSeq("a2", list(range(9)))
    assert bm.allocate(again) == 8
    assert bm.block_table("a2") == [0, 1, 2]
    assert bm.free_queue() == [3, 4, 5, 6, 7]
    bm.check_integrity()


def test_eviction_reuses_least_recently_freed_cached_block(bm: BlockManager) -> None:
    x = FakeSeq("x", [1, 1, 1, 1])
    y = FakeSeq("y", [2, 2, 2, 2])
    run_prefill(bm, x)  # block 0, computed in full -> cached
    run_prefill(bm, y)  # block 1
    assert bm.block_key(0) == x.block_keys[0]
    assert bm.block_key(1) == y.block_keys[0]
    bm.free(x)
    bm.free(y)
    assert bm.free_queue() == [2, 3, 4, 5, 6, 7, 0, 1]
    big = FakeSeq("big", list(range(100, 124)))  # 6 blocks: all uncached ones, then block 0
    assert bm.can_allocate(big)
    bm.allocate(big)
    assert bm.block_table("big") == [2, 3, 4, 5, 6, 7]
    bm.free(big)  # unkeyed: to the head, last-first
    assert bm.free_queue() == [2, 3, 4, 5, 6, 7, 0, 1]
    bigger = FakeSeq("bigger", list(range(200, 228)))  # 7 blocks: evicts block 0 (x), keeps y
    bm.allocate(bigger)
    assert bm.block_table("bigger") == [2, 3, 4, 5, 6, 7, 0]
    assert bm.block_key(0) is None
    assert bm.block_key(1) == y.block_keys[0]
    assert bm.num_cached_blocks == 1
    bm.check_integrity()
    bm.free(bigger)
    assert bm.free_queue() == [2, 3, 4, 5, 6, 7, 0, 1]
    y2 = FakeSeq("y2", [2, 2, 2, 2, 9])
    assert bm.allocate(y2) == 4  # y's block survived eviction
    assert bm.block_table("y2") == [1, 2]
    bm.check_integrity()


def test_can_allocate_counts_free_cached_hits(bm: BlockManager) -> None:
    a = FakeSeq("a", list(range(12)))  # 3 full blocks: 0,1,2
    run_prefill(bm, a)
    bm.free(a)
    filler = FakeSeq("f", list(range(500, 520)))  # 5 blocks: the uncached 3..7
    bm.allocate(filler)
    assert bm.num_free_blocks == 3  # 2, 1, 0 (cached, free)
    # Hits blocks 0,1 (free cached) and needs 1 new block: 3 free, 2 of them are the hits -> ok.
    b = FakeSeq("b", list(range(8)) + [7, 7, 7])
    assert bm.can_allocate(b)
    # Hits 0,1 (block 2's key differs) and needs 3 new blocks: only 1 is left besides the hits.
    c = FakeSeq("c", list(range(8)) + [7] * 12)
    assert not bm.can_allocate(c)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(c)
    assert bm.allocate(b) == 8
    assert bm.block_table("b") == [0, 1, 2]  # block 2 evicted (its key differed) and reused
    assert bm.num_cached_blocks == 2
    bm.check_integrity()


def test_append_slots_grows_and_registers(bm: BlockManager) -> None:
    seq = FakeSeq("d", [5, 6, 7])
    bm.allocate(seq)
    seq.num_computed_tokens = 3
    bm.cache_computed_blocks(seq)
    seq.append(8)  # 4 tokens, still one block
    assert bm.can_append(seq)
    bm.append_slots(seq)
    assert bm.block_table("d") == [0]
    seq.num_computed_tokens = 4
    seq.append(9)  # 5 tokens: needs block 1; block 0 now fully computed
    bm.append_slots(seq)
    assert bm.block_table("d") == [0, 1]
    assert bm.block_key(0) == seq.block_keys[0]
    bm.check_integrity()


def test_append_slots_raises_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = FakeSeq("d", list(range(8)))
    bm.allocate(seq)
    seq.num_computed_tokens = 8
    seq.append(1)
    assert not bm.can_append(seq)
    with pytest.raises(OutOfBlocksError):
        bm.append_slots(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 2
    bm.check_integrity()


def test_shared_block_freed_only_when_last_user_frees(bm: BlockManager) -> None:
    a = FakeSeq("a", list(range(9)))
    run_prefill(bm, a)
    b = FakeSeq("b", list(range(9)))
    assert bm.allocate(b) == 8
    assert bm.block_table("b") == [0, 1, 3]
    bm.free(a)
    assert [bm.ref_count(x) for x in range(4)] == [1, 1, 0, 1]
    assert bm.free_queue() == [2, 4, 5, 6, 7]
    bm.free(b)
    assert bm.free_queue() == [3, 2, 4, 5, 6, 7, 1, 0]
    bm.free(b)  # double free is a no-op
    bm.check_integrity()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = FakeSeq("a", list(range(9)))
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 0
    b = FakeSeq("b", list(range(9)))
    assert bm.allocate(b) == 0
    assert bm.block_table("b") == [3, 4, 5]
    bm.check_integrity()


def test_check_integrity_detects_corruption(bm: BlockManager) -> None:
    a = FakeSeq("a", list(range(9)))
    run_prefill(bm, a)
    bm._ref_counts[0] += 1  # simulate a bug outside the owner
    with pytest.raises(AssertionError, match="block 0: ref count 2 but in 1 tables"):
        bm.check_integrity()
    bm._ref_counts[0] -= 1
    bm._free[1] = None
    with pytest.raises(AssertionError, match="free 6 \\+ used 3 != total 8"):
        bm.check_integrity()
    del bm._free[1]
    bm.check_integrity()


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)


def test_pinned_blocks_outlive_their_sequence_and_are_not_handed_out(bm: BlockManager) -> None:
    seq = FakeSeq("a", list(range(8)))  # 2 full blocks: ids 0, 1
    run_prefill(bm, seq)
    bm.pin([0, 1])
    assert [bm.ref_count(b) for b in (0, 1)] == [2, 2]
    bm.free(seq)  # the sequence ends while a reader still copies its blocks
    bm.check_integrity()
    assert [bm.ref_count(b) for b in (0, 1)] == [1, 1]
    assert 0 not in bm.free_queue() and 1 not in bm.free_queue()
    other = FakeSeq("b", list(range(100, 124)))  # 6 blocks: every free block, none of the pinned
    assert bm.can_allocate(other)
    bm.allocate(other)
    assert sorted(bm.block_table("b")) == [2, 3, 4, 5, 6, 7]
    assert not bm.can_append(FakeSeq("b", list(range(100, 125))))
    bm.free(other)
    bm.unpin([0])
    bm.check_integrity()
    assert bm.ref_count(0) == 0 and bm.num_pins(0) == 0 and bm.num_pins(1) == 1
    assert bm.free_queue()[-1] == 0  # a cached block, freed last: at the tail
    bm.unpin([1])
    assert bm.num_free_blocks == 8


def test_pin_refuses_free_blocks_without_kv_and_unpin_refuses_unpinned(bm: BlockManager) -> None:
    seq = FakeSeq("a", list(range(6)))  # block 0 full (cached), block 1 partial (no key)
    run_prefill(bm, seq)
    bm.free(seq)
    with pytest.raises(ValueError, match=r"cannot pin free blocks \[1\] that hold no cached KV"):
        bm.pin([0, 1])
    assert bm.ref_count(0) == 0 and 0 in bm.free_queue()  # nothing was pinned
    bm.pin([0])  # free but cached: its KV is intact, and now it stays so
    assert bm.ref_count(0) == 1 and 0 not in bm.free_queue()
    bm.check_integrity()
    bm.unpin([0])
    assert bm.free_queue()[-1] == 0  # back at the tail, as the most recently used cached block
    with pytest.raises(AssertionError, match="not pinned"):
        bm.unpin([0])


def test_cache_events_record_stores_and_evictions_in_order() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    bm.record_events = True
    a = FakeSeq("a", list(range(8)))
    run_prefill(bm, a)
    keys_a = a.block_keys
    events = bm.drain_events()
    assert [(e.key, e.stored, e.block_id) for e in events] == [(keys_a[0], True, 0), (keys_a[1], True, 1)]
    assert bm.drain_events() == []
    assert sorted(bm.cached_keys()) == sorted(keys_a)
    bm.free(a)
    b = FakeSeq("b", list(range(50, 54)))  # one new block: evicts the least recently freed key
    run_prefill(bm, b)
    events = bm.drain_events()
    # freed last-first, so block 1 joined the free queue first and is evicted first
    assert [(e.key, e.stored) for e in events] == [(keys_a[1], False), (b.block_keys[0], True)]
    bm.free(b)
    bm.check_integrity()


def test_events_are_not_recorded_unless_asked(bm: BlockManager) -> None:
    seq = FakeSeq("a", list(range(8)))
    run_prefill(bm, seq)
    assert bm.drain_events() == []
    bm.free(seq)
