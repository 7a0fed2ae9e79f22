"""Continuous batching with chunked prefill and preemption by recompute.

Each ``schedule()`` fills one forward pass under two limits: ``max_num_batched_tokens`` tokens and
``max_num_seqs`` running sequences. A step that decodes nothing may take up to
``max_prefill_step_tokens`` instead (when larger): chunking a prompt keeps running decodes
flowing, and with none running it only costs time (a 1,024-token prompt of the demo model on two
threads: 59 ms in one step against 68 in two of 512). Order of service:

Sequences are served by priority (vLLM's: the lower first; 0 by default), then first come first
served: ``waiting`` and ``running`` are kept in that order, equals in their arrival (admission) order.

1. Running decodes (one token each), in that order. A decode that needs a new block and finds none
   preempts the *last* running sequence (possibly itself): of the lowest priority, the last
   admitted. Its blocks are freed, its computed counter resets to 0 and it goes back to the waiting
   queue, ahead of its equals; on re-admission it recomputes prompt + generated tokens (and may hit
   the prefix cache).
2. Running prefills (a prompt or a recompute that did not finish in earlier steps): the next chunk.
3. Waiting sequences, in their order, while they fit (blocks for all their tokens are taken
   at admission, reusing the longest cached prefix). Skipped in a step that preempted. A sequence
   whose leading KV is to be imported (``kv_import_tokens`` past its cached prefix) is admitted into
   ``loading`` instead: it gets no chunk, and the batch lists a :class:`KVLoad` naming the blocks
   to fill. ``finish_load`` moves it to ``running`` once the copy is done. Such a sequence is
   admitted even when the step's tokens are spent -- passing prompts that wait for tokens -- so
   the copy of a request handed over by a prefill instance overlaps the long prompt chunks of a
   busy decode instance instead of waiting for them to end. A sequence awaiting its first token (its
   prompt still prefilled elsewhere) is admitted only while such sequences hold at most
   ``AWAITING_SHARE`` of the pool (or none does); past it, it is passed over and waits: blocks
   reserved for prefills still running must not preempt the sequences decoding here.

The result is a plain :class:`ScheduledBatch`. After the forward pass the engine calls
``update_after_step`` so the computed counters and the prefix cache follow what the model wrote.
Not thread-safe: one engine thread owns it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from yutu.engine.sequence import RequestStatus, Sequence
from yutu.kv.block_manager import BlockManager

AWAITING_SHARE = 0.5  # of the block pool, at most, held by sequences awaiting their first token


@dataclass(frozen=True)
class ScheduledChunk:
    """The next tokens of one sequence to run this step.

    Positions ``start .. start + len(token_ids) - 1`` of the sequence; ``block_table`` covers them.
    ``sample`` is set when the chunk ends at the sequence's last token (so the model's output at the
    chunk's last row is sampled).
    """

    seq_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of the sequence in the cache once this chunk is written."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class KVLoad:
    """Blocks of one admitted sequence to fill from outside before it can run.

    ``block_ids[i]`` is the sequence's block number ``first_block + i``; together they cover tokens
    ``[num_cached_tokens, num_tokens)`` of the sequence, where ``num_cached_tokens`` (a multiple of
    the block size) came from this engine's own prefix cache.
    """

    seq_id: str
    first_block: int
    block_ids: list[int]
    num_cached_tokens: int
    num_tokens: int  # the sequence's kv_import_tokens

    @property
    def needed(self) -> bool:
        """False when the prefix cache already covered the import: the sequence runs at once, and
        the load only tells the caller its source is not needed (no ``finish_load`` then)."""
        return bool(self.block_ids)


@dataclass
class ScheduledBatch:
    """One forward pass: chunks laid end to end in this order, what was preempted to make room, and
    the sequences admitted to wait for imported KV (they have no chunk)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_seq_ids: list[str] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def without(self, seq_ids: set[str]) -> ScheduledBatch:
        """This batch minus the chunks of ``seq_ids`` (requests failed during the step)."""
        if not seq_ids:
            return self
        return ScheduledBatch(
            [c for c in self.chunks if c.seq_id not in seq_ids], self.preempted_seq_ids, self.loads
        )


class Scheduler:
    """Owns the waiting queue and the running list; asks the block manager for room."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_step_tokens: int | None = None) -> None:  # fmt: skip
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_prefill_step_tokens is not None and max_prefill_step_tokens < 1:
            raise ValueError(f"max_prefill_step_tokens must be >= 1 or None, got {max_prefill_step_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the budget of a step that decodes nothing (never below the usual one)
        self.max_prefill_step_tokens = max(max_num_batched_tokens, max_prefill_step_tokens or 0)
        self.waiting: deque[Sequence] = deque()  # by priority, then arrival
        # by priority, then admission; the last one is the preemption victim
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}  # admitted, waiting for imported KV; never preempted
        # Aborted while loading: their blocks stay allocated until the copy into them has ended
        # (finish_load), or the copy would write into blocks another sequence may own by then.
        self.abandoned: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        assert seq.status is RequestStatus.WAITING
        self._queue(seq)

    def _queue(self, seq: Sequence, ahead: bool = False) -> None:
        """Into ``waiting`` by priority: behind its equals, or (``ahead``: a preempted one) before them."""
        waiting = self.waiting
        if not ahead and (not waiting or waiting[-1].priority <= seq.priority):
            waiting.append(seq)  # the usual case: one priority for all
            return
        at = next(
            (
                i
                for i, s in enumerate(waiting)
                if (s.priority >= seq.priority if ahead else s.priority > seq.priority)
            ),
            len(waiting),
        )
        waiting.insert(at, seq)

    def _run(self, seq: Sequence) -> None:
        """Into ``running`` by priority, behind its equals."""
        running = self.running
        if not running or running[-1].priority <= seq.priority:
            running.append(seq)
            return
        running.insert(next(i for i, s in enumerate(running) if s.priority > seq.priority), seq)

    @property
    def num_prefilling(self) -> int:
        """Sequences waiting, or running with prompt tokens still to compute."""
        return len(self.waiting) + sum(1 for seq in self.running if seq.needs_prefill)

    def has_unfinished(self) -> bool:
        """Whether a step has anything to do (loading sequences wait for ``finish_load``, not a step)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        # 1. Decodes, in order; make room by preempting from the back.
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            if not seq.is_decode:
                idx += 1
                continue
            while not self.block_manager.can_append(seq) and self.running[-1] is not seq:
                batch.preempted_seq_ids.append(self._preempt(self.running.pop()).seq_id)
            if not self.block_manager.can_append(seq):
                self.running.pop()  # seq is the last one left to give up
                batch.preempted_seq_ids.append(self._preempt(seq).seq_id)
                break
            self.block_manager.append_slots(seq)
            batch.chunks.append(self._chunk(seq, 1))
            budget -= 1
            idx += 1

        if not batch.chunks and not batch.preempted_seq_ids:  # no decode to keep flowing this step
            budget = self.max_prefill_step_tokens

        # 2. Prefills already running (blocks were taken at admission).
        for seq in self.running:
            if budget == 0:
                break
            if seq.needs_prefill:
                chunk = self._chunk(seq, min(seq.num_uncomputed_tokens, budget))
                batch.chunks.append(chunk)
                budget -= chunk.num_tokens

        # 3. Admit waiting sequences in order while they fit. Once the step's tokens are spent, one
        #    whose KV is imported is still admitted, passing the prompts that wait for tokens: its
        #    load takes none of the step's tokens, and the copy overlaps the steps that follow.
        passed: list[Sequence] = []
        while (
            self.waiting
            and len(self.running) + len(self.loading) < self.max_num_seqs
            and not batch.preempted_seq_ids
        ):
            seq = self.waiting[0]
            if (budget == 0 and not seq.kv_import_tokens) or (
                seq.awaiting_token and not self._may_reserve(seq)
            ):
                passed.append(self.waiting.popleft())
                continue
            reuse = seq.prompt_logprobs is None  # a prompt whose logprobs are asked is computed whole
            if not self.block_manager.can_allocate(seq, reuse):
                break
            self.waiting.popleft()
            num_cached = self.block_manager.allocate(seq, reuse)
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
            if seq.kv_import_tokens > num_cached:
                batch.loads.append(self._load(seq, num_cached))
                continue
            if seq.kv_import_tokens:  # covered by the prefix cache: nothing to copy
                batch.loads.append(
                    KVLoad(
                        seq.seq_id,
                        num_cached // self.block_manager.block_size,
                        [],
                        num_cached,
                        seq.kv_import_tokens,
                    )
                )
                seq.kv_import_tokens = 0
            seq.status = RequestStatus.RUNNING
            self._run(seq)
            if budget:  # else its first chunk comes in the next step (2.)
                chunk = self._chunk(seq, min(seq.num_uncomputed_tokens, budget))
                batch.chunks.append(chunk)
                budget -= chunk.num_tokens
        self.waiting.extendleft(reversed(passed))  # back at the front, in their order
        return batch

    def update_after_step(self, batch: ScheduledBatch) -> None:
        """Mark each chunk's tokens computed and publish newly full blocks to the prefix cache."""
        running = {seq.seq_id: seq for seq in self.running}
        for chunk in batch.chunks:
            seq = running[chunk.seq_id]
            assert seq.num_computed_tokens == chunk.start, (seq, chunk.start)
            seq.num_computed_tokens = chunk.context_len
            self.block_manager.cache_computed_blocks(seq)

    def finish_load(self, seq: Sequence, num_tokens: int) -> None:
        """The import of ``seq`` ended with its first ``num_tokens`` tokens' KV in place (at least its
        cached prefix; less than asked when part of the copy failed: the rest is computed). For a
        sequence aborted while loading, this is when its blocks are freed."""
        if self.abandoned.get(seq.seq_id) is seq:
            del self.abandoned[seq.seq_id]
            self.block_manager.free(seq)
            return
        assert seq.status is RequestStatus.LOADING and self.loading.get(seq.seq_id) is seq
        if not seq.num_computed_tokens <= num_tokens <= seq.kv_import_tokens:
            raise ValueError(
                f"{seq.seq_id}: loaded {num_tokens} tokens, expected between {seq.num_computed_tokens}"
                f" and {seq.kv_import_tokens}"
            )
        del self.loading[seq.seq_id]
        seq.kv_import_tokens = 0  # consumed: a preempted sequence recomputes
        seq.num_computed_tokens = num_tokens
        self.block_manager.cache_computed_blocks(seq)
        if not self.block_manager.can_append(seq):  # an awaited token that starts a block, none free:
            self._preempt(seq)  # recomputed once there is room (its imported blocks stay cached)
            return
        self.block_manager.append_slots(seq)  # a no-op unless an awaited token starts a block
        seq.status = RequestStatus.RUNNING
        self._run(seq)

    def hold(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch but keep its blocks (``HELD``): its KV is to be
        read by someone else. Free them later with ``release``."""
        assert seq.status is RequestStatus.RUNNING
        self.running.remove(seq)
        seq.status = RequestStatus.HELD

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a HELD sequence."""
        assert seq.status is RequestStatus.HELD
        self.block_manager.free(seq)
        seq.status = RequestStatus.FINISHED_ABORTED

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Retire a running or waiting sequence with a FINISHED_* status and free its blocks."""
        assert status.is_finished
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
        elif not seq.status.is_finished:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status

    def abort(self, seq: Sequence) -> None:
        """Retire ``seq`` as FINISHED_ABORTED wherever it is and free its blocks.

        Unlike ``finish`` it trusts no status: it also retires a sequence that a ``schedule()`` which
        raised left half-admitted (out of the waiting queue, not yet running). Idempotent.
        """
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.loading.pop(seq.seq_id, None) is not None:
            self.abandoned[seq.seq_id] = seq  # freed by finish_load, once the copy has ended
        elif seq.seq_id not in self.abandoned:
            self.block_manager.free(seq)
        seq.status = RequestStatus.FINISHED_ABORTED

    def _may_reserve(self, seq: Sequence) -> bool:
        """Whether ``seq``, awaiting its first token, may take blocks now (``AWAITING_SHARE``; the
        first one always may, however large: nothing else would ever let it in)."""
        bm = self.block_manager
        held = sum(len(bm.block_table(s.seq_id)) for s in self.loading.values() if s.awaiting_token)
        return held == 0 or held + -(-seq.num_tokens // bm.block_size) <= bm.num_blocks * AWAITING_SHARE

    def _load(self, seq: Sequence, num_cached: int) -> KVLoad:
        # blocks [num_cached / bs, ceil(kv_import_tokens / bs)) of the table get the imported KV
        bs = self.block_manager.block_size
        first, end = num_cached // bs, -(-seq.kv_import_tokens // bs)
        seq.status = RequestStatus.LOADING
        self.loading[seq.seq_id] = seq
        table = self.block_manager.block_table(seq.seq_id)
        return KVLoad(seq.seq_id, first, table[first:end], num_cached, seq.kv_import_tokens)

    def _chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        # token_ids[start : start + num_tokens] are computed this step; start = num_computed_tokens.
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[start : start + num_tokens],
            start=start,
            block_table=self.block_manager.block_table(seq.seq_id),
            sample=start + num_tokens == seq.num_tokens,
        )

    def _preempt(self, seq: Sequence) -> Sequence:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        self._queue(seq, ahead=True)
        self.num_preemptions += 1
        return seq
