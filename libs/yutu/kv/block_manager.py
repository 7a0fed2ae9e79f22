"""The block manager: owner of the paged KV pool's bookkeeping.

A fixed pool of block ids ``0 .. num_blocks-1``. Each block is either *used* (ref count > 0, listed
in one or more block tables) or *free* (ref count 0, in the free queue). A free block may still hold
the KV of a full block whose key is in the prefix cache; it is reused only when nothing better is
left, least recently freed first, and its key is evicted at that moment.

Free queue order (head is handed out first)::

    [ free blocks without a key ... | cached free blocks, least recently freed ... most recently freed ]
      ^ head                                                                                    tail ^

Only this class mutates ref counts, block tables, the prefix cache and the free queue. The scheduler
asks ``can_allocate`` / ``can_append`` first and preempts when they say no; ``allocate`` and
``append_slots`` raise :class:`OutOfBlocksError` when called without room (a scheduler bug).

Besides block tables, a block can be *pinned*: an extra reference held by someone who reads the
block outside a step (the write-behind to the KV store copies a block while its sequence may
finish). A pinned block is used, never handed out, until every pin is released with ``unpin``.

Every change to the prefix cache is logged as a :class:`CacheEvent` (a key stored, a key removed)
until ``drain_events`` takes them: that is what a worker publishes as KV events.

Not thread-safe: one engine thread owns it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation is attempted without enough free blocks; check ``can_*`` first."""


@dataclass(frozen=True)
class CacheEvent:
    """A prefix-cache change: ``key`` was registered (``stored``) or evicted (not ``stored``)."""

    key: bytes
    stored: bool
    block_id: int


class KVSequence(Protocol):
    """What the block manager reads from a sequence (it never writes to it)."""

    @property
    def seq_id(self) -> str: ...

    @property
    def num_tokens(self) -> int:
        """Every token of the sequence: prompt plus generated, computed or not."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V are written in the cache."""
        ...

    @property
    def block_keys(self) -> Sequence[bytes]:
        """Chained digests (``yutu.kv.hashing``) of every full block of the sequence's tokens."""
        ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Ref-counted block pool with a prefix cache and an LRU queue of free blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_key: list[bytes | None] = [None] * num_blocks  # key iff registered in the cache
        self._prefix_cache: dict[bytes, int] = {}  # key -> block id holding that key's KV
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._tables: dict[str, list[int]] = {}  # seq_id -> block ids, in token order
        self._num_registered: dict[str, int] = {}  # seq_id -> leading blocks already in the cache
        self._pins: Counter[int] = Counter()  # block id -> pins held (each one is also a ref)
        self._events: list[CacheEvent] = []  # prefix-cache changes not yet drained
        self.record_events = False  # log CacheEvents (a worker that publishes KV events turns it on)
        self.prefix_cache_queries_tokens = 0  # tokens looked up at allocation
        self.prefix_cache_hit_tokens = 0  # of those, served from the prefix cache

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose key is in the prefix cache (used or free)."""
        return len(self._prefix_cache)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running sequences, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_key(self, block_id: int) -> bytes | None:
        """The key whose KV block ``block_id`` holds, or None if it is not in the prefix cache."""
        return self._block_key[block_id]

    def cached_keys(self) -> list[bytes]:
        """Every key in the prefix cache (a snapshot; order unspecified)."""
        return list(self._prefix_cache)

    def num_pins(self, block_id: int) -> int:
        return self._pins[block_id]

    def free_queue(self) -> list[int]:
        """Free block ids, next to be handed out first (a copy, for tests and metrics)."""
        return list(self._free)

    def has_blocks(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: str) -> list[int]:
        """Block ids of ``seq_id`` in token order (a copy). Raises KeyError if it holds none."""
        return list(self._tables[seq_id])

    def lookup_prefix(self, seq: KVSequence, reuse: bool = True) -> list[int]:
        """Blocks of the prefix cache that hold ``seq``'s leading full blocks (no state change); none
        when ``reuse`` is False (the sequence must compute every token).

        Never covers the block holding the sequence's last token: at least one token is always left to
        compute, so the model produces logits for it.
        """
        if not self.enable_prefix_caching or not reuse:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in seq.block_keys[:max_blocks]:
            block_id = self._prefix_cache.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: KVSequence, reuse: bool = True) -> bool:
        """Whether ``allocate(seq, reuse)`` would succeed now."""
        hits = self.lookup_prefix(seq, reuse)
        hit_free = sum(1 for b in hits if self._ref_counts[b] == 0)
        num_new = _cdiv(seq.num_tokens, self.block_size) - len(hits)
        return num_new <= len(self._free) - hit_free

    def can_append(self, seq: KVSequence) -> bool:
        """Whether ``append_slots(seq)`` would succeed now."""
        return self._num_missing(seq) <= len(self._free)

    # ------------------------------------------------------------------ mutations

    def allocate(self, seq: KVSequence, reuse: bool = True) -> int:
        """Give ``seq`` blocks for all its tokens, reusing its longest cached prefix (unless ``reuse``
        is False).

        Returns the number of leading tokens served from the prefix cache (a multiple of
        ``block_size``, at most ``num_tokens - 1``); the caller marks them computed.
        """
        if seq.seq_id in self._tables:
            raise AssertionError(f"sequence {seq.seq_id!r} already holds blocks")
        if not self.can_allocate(seq, reuse):
            raise OutOfBlocksError(
                f"sequence {seq.seq_id!r} needs more blocks than the {len(self._free)} free ones"
            )
        hits = self.lookup_prefix(seq, reuse)
        table: list[int] = []
        for block_id in hits:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            table.append(block_id)
        for _ in range(_cdiv(seq.num_tokens, self.block_size) - len(hits)):
            table.append(self._take_free_block())
        self._tables[seq.seq_id] = table
        self._num_registered[seq.seq_id] = len(hits)
        num_cached = len(hits) * self.block_size
        self.prefix_cache_queries_tokens += seq.num_tokens
        self.prefix_cache_hit_tokens += num_cached
        return num_cached

    def append_slots(self, seq: KVSequence) -> None:
        """Grow ``seq``'s table to cover all its tokens (decode growth) and cache its computed blocks."""
        missing = self._num_missing(seq)
        if missing > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq.seq_id!r} needs {missing} blocks, only {len(self._free)} are free"
            )
        table = self._tables[seq.seq_id]
        for _ in range(missing):
            table.append(self._take_free_block())
        self.cache_computed_blocks(seq)

    def cache_computed_blocks(self, seq: KVSequence) -> None:
        """Register the keys of ``seq``'s full blocks whose K/V are all computed.

        Call after each step that computed tokens of ``seq``. A key already in the cache (another
        sequence computed the same block first) keeps its block; ours then stays unkeyed.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq.seq_id]
        done = self._num_registered[seq.seq_id]
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_keys), len(table))
        for i in range(done, full):
            key = seq.block_keys[i]
            block_id = table[i]
            if key not in self._prefix_cache and self._block_key[block_id] is None:
                self._prefix_cache[key] = block_id
                self._block_key[block_id] = key
                if self.record_events:
                    self._events.append(CacheEvent(key, True, block_id))
        self._num_registered[seq.seq_id] = max(done, full)

    def pin(self, block_ids: Iterable[int]) -> None:
        """Take an extra reference on blocks whose KV is stable: in use, or free but still holding a
        prefix-cache key (a sequence that finished this step; its KV stays until the block is handed
        out, which a pin now prevents).

        Raises ValueError, pinning nothing, if any block is free without a key: its KV means nothing.
        """
        ids = list(block_ids)
        loose = [b for b in ids if self._ref_counts[b] == 0 and self._block_key[b] is None]
        if loose:
            raise ValueError(f"cannot pin free blocks {loose[:5]} that hold no cached KV")
        for block_id in ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            self._pins[block_id] += 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Release pins taken with :meth:`pin`; a block whose last reference goes becomes free."""
        for block_id in block_ids:
            if self._pins[block_id] <= 0:
                raise AssertionError(f"block {block_id} is not pinned")
            self._pins[block_id] -= 1
            if self._pins[block_id] == 0:
                del self._pins[block_id]
            self._release(block_id)

    def drain_events(self) -> list[CacheEvent]:
        """The prefix-cache changes since the last call, in order."""
        events, self._events = self._events, []
        return events

    def free(self, seq: KVSequence) -> None:
        """Release ``seq``'s blocks; those whose ref count reaches 0 join the free queue.

        Blocks are released last-first, so a sequence's tail blocks are reused before its head. Cached
        blocks keep their key (and KV) until handed out again; unkeyed ones go to the head of the queue.
        No-op if ``seq`` holds no blocks.
        """
        table = self._tables.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None  # tail: most recently freed
            if self._block_key[block_id] is None:
                self._free.move_to_end(block_id, last=False)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        key = self._block_key[block_id]
        if key is not None:  # evict: its KV is about to be overwritten
            del self._prefix_cache[key]
            self._block_key[block_id] = None
            if self.record_events:
                self._events.append(CacheEvent(key, False, block_id))
        self._ref_counts[block_id] = 1
        return block_id

    def _num_missing(self, seq: KVSequence) -> int:
        return max(0, _cdiv(seq.num_tokens, self.block_size) - len(self._tables[seq.seq_id]))

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise AssertionError listing every broken invariant of the pool, if any.

        Checks: free + used == total; ref counts equal table occurrences plus pins; ref 0 iff in the free queue
        (an ordered dict, so no block can sit in it twice); no block twice in one table; every cache
        entry points at a block holding that key and every keyed block is its key's entry.
        """
        errors: list[str] = []
        used = sum(1 for r in self._ref_counts if r > 0)
        if used + len(self._free) != self.num_blocks:
            errors.append(f"free {len(self._free)} + used {used} != total {self.num_blocks}")
        expected = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                errors.append(f"sequence {seq_id!r} lists a block twice: {table}")
            for block_id in table:
                expected[block_id] += 1
            if self._num_registered[seq_id] > len(table):
                errors.append(f"sequence {seq_id!r} registered more blocks than it holds")
        for block_id, pins in self._pins.items():
            if pins <= 0:
                errors.append(f"block {block_id}: {pins} pins recorded")
        for block_id in range(self.num_blocks):
            ref = self._ref_counts[block_id]
            pins = self._pins.get(block_id, 0)
            if ref != expected[block_id] + pins:
                errors.append(
                    f"block {block_id}: ref count {ref} but in {expected[block_id]} tables and {pins} pins"
                )
            if ref < 0:
                errors.append(f"block {block_id}: negative ref count {ref}")
            if (ref == 0) != (block_id in self._free):
                errors.append(
                    f"block {block_id}: ref count {ref} but in free queue: {block_id in self._free}"
                )
            key = self._block_key[block_id]
            if key is not None and self._prefix_cache.get(key) != block_id:
                errors.append(f"block {block_id} claims key {key.hex()} which maps elsewhere")
        for key, block_id in self._prefix_cache.items():
            if self._block_key[block_id] != key:
                errors.append(f"prefix cache {key.hex()} -> block {block_id} which holds another key")
        if not self.enable_prefix_caching and self._prefix_cache:
            errors.append("prefix caching is disabled but the cache is not empty")
        if errors:
            raise AssertionError("block manager integrity: " + "; ".join(errors))
