"""Scheduler control logic with real Sequences and a real BlockManager (no model)."""

from __future__ import annotations

import pytest
from yutu.engine.sampling import SamplingParams
from yutu.engine.scheduler import ScheduledBatch, Scheduler
from yutu.engine.sequence import RequestStatus, Sequence
from yutu.kv.block_manager import BlockManager
from yutu.kv.hashing import root_key

BS = 4
ROOT = root_key("sched-test")


def make_seq(seq_id: str, n: int, first: int = 0, max_tokens: int = 16) -> Sequence:
    return Sequence(seq_id, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), BS, ROOT)


def step(sched: Scheduler, batch: ScheduledBatch, next_token: int = 7) -> None:
    """What the engine does after the forward pass: commit computed tokens, append sampled ones."""
    sched.update_after_step(batch)
    for chunk in batch.chunks:
        if chunk.sample:
            seq = next(s for s in sched.running if s.seq_id == chunk.seq_id)
            seq.append_token(next_token)
    sched.block_manager.check_integrity()


def layout(batch: ScheduledBatch) -> list[tuple[str, int, int, bool]]:
    return [(c.seq_id, c.start, c.num_tokens, c.sample) for c in batch.chunks]


def test_sequence_counters_drive_prefill_and_decode() -> None:
    seq = make_seq("a", 6)
    assert seq.needs_prefill and not seq.is_decode
    seq.num_computed_tokens = 6
    seq.append_token(9)
    assert seq.is_decode and not seq.needs_prefill
    assert seq.output_token_ids == [9] and seq.num_output_tokens == 1
    one = make_seq("b", 1)
    assert one.is_decode  # a one-token prompt is computed like a decode step
    assert RequestStatus.FINISHED_LENGTH.is_finished and not RequestStatus.PREEMPTED.is_finished


def test_sequence_block_keys_follow_appends() -> None:
    from yutu.kv.hashing import block_key_digests

    seq = make_seq("a", 3)
    assert seq.block_keys == []
    seq.append_token(100)
    seq.append_token(101)
    seq.append_token(102)
    seq.append_token(103)
    seq.append_token(104)
    assert seq.block_keys == block_key_digests(ROOT, [0, 1, 2, 100, 101, 102, 103, 104], BS)
    assert len(seq.block_keys) == 2


def test_chunked_prefill_then_decode() -> None:
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=5)
    sched.add(make_seq("a", 12))
    sched.add(make_seq("b", 3, first=50))
    b1 = sched.schedule()
    assert layout(b1) == [("a", 0, 5, False)]  # b waits: no budget left
    assert b1.chunks[0].block_table == [0, 1, 2]
    step(sched, b1)
    b2 = sched.schedule()
    assert layout(b2) == [("a", 5, 5, False)]
    step(sched, b2)
    b3 = sched.schedule()
    assert layout(b3) == [("a", 10, 2, True), ("b", 0, 3, True)]
    assert b3.chunks[1].block_table == [3]
    step(sched, b3)
    b4 = sched.schedule()
    assert layout(b4) == [("a", 12, 1, True), ("b", 3, 1, True)]
    assert b4.chunks[0].token_ids == [7]
    assert b4.chunks[0].block_table == [0, 1, 2, 4]  # a grew into block 4 for token 12
    step(sched, b4)
    assert bm.num_cached_blocks == 4  # a's 3 full blocks and b's first block
    bm.check_integrity()


def test_decodes_first_then_running_prefill_then_waiting() -> None:
    bm = BlockManager(32, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    sched.add(make_seq("a", 2))
    step(sched, sched.schedule())  # a: prefill done, now decoding
    sched.add(make_seq("b", 9, first=100))
    sched.add(make_seq("c", 2, first=200))
    b = sched.schedule()
    assert layout(b) == [("a", 2, 1, True), ("b", 0, 5, False)]
    step(sched, b)
    b = sched.schedule()
    assert layout(b) == [("a", 3, 1, True), ("b", 5, 4, True), ("c", 0, 1, False)]
    step(sched, b)
    b = sched.schedule()
    assert layout(b) == [("a", 4, 1, True), ("b", 9, 1, True), ("c", 1, 1, True)]


def test_a_step_that_decodes_nothing_takes_the_larger_prefill_budget() -> None:
    bm = BlockManager(32, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=5, max_prefill_step_tokens=12)
    sched.add(make_seq("a", 10))
    sched.add(make_seq("b", 3, first=50))
    b = sched.schedule()  # nothing decodes: a's whole prompt and b's first 2 tokens in one step
    assert layout(b) == [("a", 0, 10, True), ("b", 0, 2, False)]
    step(sched, b)
    sched.add(make_seq("c", 9, first=100))
    b = sched.schedule()  # a decodes now: the usual budget, so c's prompt is chunked behind it
    assert layout(b) == [("a", 10, 1, True), ("b", 2, 1, True), ("c", 0, 3, False)]
    assert Scheduler(bm, 8, 5, max_prefill_step_tokens=3).max_prefill_step_tokens == 5  # never below


def test_max_num_seqs_limits_admission() -> None:
    bm = BlockManager(32, BS)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(make_seq(f"s{i}", 3, first=10 * i))
    b = sched.schedule()
    assert [c.seq_id for c in b.chunks] == ["s0", "s1"]
    assert [s.seq_id for s in sched.waiting] == ["s2"]


def test_prefix_hit_sets_computed_and_cached_tokens() -> None:
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(make_seq("a", 10))
    step(sched, sched.schedule())
    sched.add(make_seq("b", 10))
    b = sched.schedule()
    assert layout(b) == [("a", 10, 1, True), ("b", 8, 2, True)]
    seq_b = sched.running[1]
    assert seq_b.num_cached_tokens == 8
    assert b.chunks[1].block_table[:2] == [0, 1]
    assert bm.prefix_cache_hit_tokens == 8


def test_preemption_frees_last_admitted_and_recomputes() -> None:
    # 4 blocks of 4 tokens. a (4 tokens) and b (4 tokens) each fill one block, c fills two.
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(make_seq("a", 4, first=0))
    sched.add(make_seq("b", 4, first=10))
    sched.add(make_seq("c", 8, first=20))
    b = sched.schedule()
    assert layout(b) == [("a", 0, 4, True), ("b", 0, 4, True), ("c", 0, 8, True)]
    assert bm.num_free_blocks == 0
    step(sched, b)  # every sequence now has 5 tokens / needs a new block; none is free
    b = sched.schedule()
    # a needs a block: preempt c (last admitted, frees 2 blocks) -> a and b both fit.
    assert b.preempted_seq_ids == ["c"]
    assert layout(b) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert sched.num_preemptions == 1
    seq_c = sched.waiting[0]
    assert seq_c.seq_id == "c" and seq_c.status is RequestStatus.PREEMPTED
    assert seq_c.num_computed_tokens == 0 and seq_c.num_tokens == 9
    assert not bm.has_blocks("c")
    step(sched, b)
    bm.check_integrity()
    # c's freed blocks (3, then 2: tail first) went to a and b, evicting c's keys.
    assert bm.block_table("a") == [0, 3] and bm.block_table("b") == [1, 2]
    assert bm.num_cached_blocks == 2  # a's and b's first blocks
    # Finish a and b; c comes back and recomputes prompt + its generated token from scratch.
    for seq_id in ("a", "b"):
        seq = next(s for s in sched.running if s.seq_id == seq_id)
        sched.finish(seq, RequestStatus.FINISHED_LENGTH)
    b = sched.schedule()
    assert layout(b) == [("c", 0, 9, True)]
    assert b.chunks[0].token_ids == list(range(20, 28)) + [7]
    assert seq_c.num_cached_tokens == 0  # first-admission figure is kept
    assert seq_c.status is RequestStatus.RUNNING
    bm.check_integrity()


def test_lone_sequence_preempts_itself_only_if_nothing_else() -> None:
    bm = BlockManager(2, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 4, first=10))
    step(sched, sched.schedule())
    b = sched.schedule()  # a needs a block: preempts b; then a fits
    assert b.preempted_seq_ids == ["b"]
    assert layout(b) == [("a", 4, 1, True)]
    step(sched, b)
    # b stays waiting while a holds both blocks; no admission in a preempting step.
    assert [s.seq_id for s in sched.waiting] == ["b"]


def test_self_preemption_when_victim_is_itself() -> None:
    bm = BlockManager(3, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 8, first=10))
    step(sched, sched.schedule())
    seq_b = sched.running[1]
    sched.finish(sched.running[0], RequestStatus.FINISHED_ABORTED)  # leaves b, 1 free block
    sched.add(make_seq("c", 3, first=30))
    b = sched.schedule()  # b decodes into the free block; c must wait
    assert layout(b) == [("b", 8, 1, True)]
    step(sched, b)
    assert seq_b.status is RequestStatus.RUNNING


def test_finish_from_waiting_and_running() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_seq("a", 5), make_seq("b", 5, first=9)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == 8
    assert a.status.finish_reason is not None and a.status.finish_reason.value == "abort"
    bm.check_integrity()


def test_bad_limits() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(BlockManager(4, BS), max_num_seqs=0, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(BlockManager(4, BS), max_num_seqs=1, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_prefill_step_tokens"):
        Scheduler(BlockManager(4, BS), max_num_seqs=1, max_num_batched_tokens=4, max_prefill_step_tokens=0)


def test_resume_after_preemption_hits_prefix_cache() -> None:
    bm = BlockManager(5, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, c = make_seq("a", 4), make_seq("c", 8, first=20)
    sched.add(a)
    sched.add(c)
    step(sched, sched.schedule())  # a: block 0, c: blocks 1, 2
    for _ in range(4):  # a grows into block 3, c into block 4; a reaches 9 tokens, c 13
        b = sched.schedule()
        assert b.preempted_seq_ids == []
        step(sched, b)
    assert (a.num_tokens, c.num_tokens) == (9, 13)
    assert bm.block_table("a") == [0, 3] and bm.block_table("c") == [1, 2, 4]
    b = sched.schedule()  # a needs a third block: preempt c; c's blocks 4, 2, 1 join the tail
    assert b.preempted_seq_ids == ["c"]
    assert bm.block_table("a") == [0, 3, 4]  # least recently freed of c's blocks: its tail
    step(sched, b)
    sched.finish(a, RequestStatus.FINISHED_LENGTH)
    b = sched.schedule()
    assert layout(b) == [("c", 8, 5, True)]  # c's first two blocks survived: 8 tokens reused
    assert b.chunks[0].block_table[:2] == [1, 2]
    assert c.num_cached_tokens == 0  # num_cached_tokens is the first admission's figure
    step(sched, b)


def test_a_handed_over_request_loads_while_a_long_prompt_takes_every_token_of_the_step() -> None:
    """A decode instance that took a long prompt on (prefill stealing) spends each step's tokens on
    its chunks; a request handed over by a prefill instance needs none of them to start its KV copy,
    so it is admitted (passing a prompt that waits for tokens) and decodes as soon as it loaded."""
    bm = BlockManager(32, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=5)
    sched.add(make_seq("p", 30))
    b1 = sched.schedule()
    assert layout(b1) == [("p", 0, 5, False)]
    step(sched, b1)
    sched.add(make_seq("q", 4, first=200))  # a prompt: waits for tokens
    handed = make_seq("h", 8, first=100)
    handed.append_token(42)  # its first token, sampled by the prefill instance
    handed.kv_import_tokens = 8  # the prompt's KV comes from there
    sched.add(handed)
    b2 = sched.schedule()
    assert layout(b2) == [("p", 5, 5, False)]  # p took every token of the step
    (load,) = b2.loads
    assert load.seq_id == "h" and len(load.block_ids) == 2 and "h" in sched.loading
    assert [s.seq_id for s in sched.waiting] == ["q"]  # still first in line for tokens
    step(sched, b2)
    sched.finish_load(handed, 8)
    b3 = sched.schedule()
    assert layout(b3) == [("h", 8, 1, True), ("p", 10, 4, False)]  # h decodes; q still waits
    assert [s.seq_id for s in sched.waiting] == ["q"]
    step(sched, b3)


def prioritized(seq_id: str, n: int, first: int, priority: int) -> Sequence:
    seq = make_seq(seq_id, n, first=first)
    seq.priority = priority
    return seq


def test_priority_orders_admission_then_arrival_and_preempts_the_lowest() -> None:
    """vLLM's priority: the lower value first, equals first come first served, in the queue and
    among the running; a decode short of blocks preempts the lowest priority, the last admitted of
    those, and it goes back ahead of its equals in the queue."""
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=64)
    for seq_id, priority in [("a", 1), ("b", 0), ("c", 1), ("d", -2), ("e", 0)]:
        sched.add(prioritized(seq_id, 4, first=10 * len(sched.waiting), priority=priority))
    assert [s.seq_id for s in sched.waiting] == ["d", "b", "e", "a", "c"]
    b = sched.schedule()
    assert layout(b) == [("d", 0, 4, True), ("b", 0, 4, True), ("e", 0, 4, True)]  # max_num_seqs 3
    step(sched, b)  # each needs a second block now: one is free
    b = sched.schedule()
    # d takes the free block; b needs one: e (lowest priority running, last) goes; b takes its block
    assert b.preempted_seq_ids == ["e"] and layout(b) == [("d", 4, 1, True), ("b", 4, 1, True)]
    assert [s.seq_id for s in sched.waiting] == ["e", "a", "c"]  # ahead of a and c (priority 1)
    late = prioritized("f", 4, first=90, priority=0)
    sched.add(late)
    assert [s.seq_id for s in sched.waiting] == ["e", "f", "a", "c"]  # behind its equal e
    sched.add(prioritized("g", 4, first=95, priority=-5))
    assert sched.waiting[0].seq_id == "g"
    step(sched, b)
    sched.finish(sched.running[0], RequestStatus.FINISHED_LENGTH)  # d: two blocks free
    b = sched.schedule()
    assert [c.seq_id for c in b.chunks] == ["b", "g"]  # g admitted (one seq slot), b decodes
    assert [s.seq_id for s in sched.running] == ["g", "b"]  # by priority: g's -5 first


def test_equal_priorities_are_first_come_first_served_whatever_the_value() -> None:
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(5):
        sched.add(prioritized(f"s{i}", 3, first=10 * i, priority=7))
    assert [c.seq_id for c in sched.schedule().chunks] == [f"s{i}" for i in range(5)]
