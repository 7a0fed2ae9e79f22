"""The dense decode cache: a head-major copy of the KV of decoding sequences, attended in place.

Paged attention (``yutu.engine.attention``) gathers every block of every decoding sequence's whole
context into a padded copy, in every layer, at every step: at 16 sequences of 1k tokens that copy is
most of a CPU decode step. Here each decoding sequence owns a *slot* of one contiguous buffer per
layer, ``(slots, kvh, capacity, hd)``, holding the K and V of its positions in order, so a step
appends one token per sequence and attends with two batched matmuls over views -- no gather.

The paged cache stays the source of truth (prefix sharing, imports, the store and peers all read
and write it). A slot is filled *from* it: each step copies, after the layer wrote the step's K/V,
the positions ``filled .. context_len - 1`` of each sequence (usually just the new token, by one
indexed copy for all sequences; a whole context the first time, block by block). A sequence missing from a step's decodes (finished, aborted, preempted,
prefilling again) loses its slot, so a slot never outlives the KV it copied.

Budget: the buffers grow by doubling (slots and capacity) within ``budget_bytes``; a decode that
does not fit (no slot left, or a context past the capacity the budget allows) runs on the paged
path that step. Both paths compute the same attention; tests check they agree.

Shapes: nh query heads, kvh key/value heads, G = nh // kvh query heads per KV head (query head
``h`` reads KV head ``h // G``, Hugging Face's ``repeat_kv``), hd head dim, n slots in use.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from yutu.engine.attention import sdpa

MIN_CAPACITY = 256  # tokens per slot at first; doubled as contexts grow
MIN_SLOTS = 4


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class DenseDecode:
    """One decoding sequence of this step on the dense path."""

    seq_index: int  # its index in the step's AttentionMetadata
    row: int  # its token's row in the flat batch
    slot: int
    context_len: int


class DenseStep:
    """The dense path of one forward pass: which decodes it takes, and the index tensors it uses.

    Built by :meth:`DenseDecodeCache.plan` before the forward; every layer calls :meth:`fill` (after
    writing its K/V to the paged cache) and :meth:`attend` with its own layer index.
    """

    def __init__(self, cache: DenseDecodeCache, decodes: list[DenseDecode], fills: list[tuple[int, int, int, int]],
                 wholes: list[tuple[int, int, list[int]]], block_size: int) -> None:  # fmt: skip
        self.cache = cache
        self.decodes = decodes
        self.seq_indices = frozenset(d.seq_index for d in decodes)
        device = cache.device
        self.width = max(d.slot for d in decodes) + 1  # slots 0 .. width-1 are attended (holes masked)
        self.span = max(d.context_len for d in decodes)  # keys attended per slot
        self.rows = torch.tensor([d.row for d in decodes], dtype=torch.int64, device=device)  # (D,)
        self.slots = torch.tensor([d.slot for d in decodes], dtype=torch.int64, device=device)  # (D,)
        lens = torch.ones(self.width, dtype=torch.int64)  # holes: one (stale) key, never read back
        for d in decodes:
            lens[d.slot] = d.context_len
        self.lens = lens.to(device)  # (width,)
        # Slots 0 .. width-1 all attended, each holding the token of the row of its number (a step
        # of decodes only, in slot order): attend reads q and writes out without a gather or scatter.
        self.aligned = len(decodes) == self.width and all(d.slot == d.row for d in decodes)
        # Positions to copy from the paged cache: (slot, position) <- (block, offset).
        fill = torch.tensor(fills, dtype=torch.int64).view(-1, 4).t().contiguous().to(device)  # (4, F)
        self.fill_slots, self.fill_pos = fill[0], fill[1]  # (F,), (F,), each contiguous
        self.fill_blocks, self.fill_offsets = fill[2], fill[3]  # (F,), (F,)
        # Slots filled from scratch (a sequence new to the cache): (slot, context_len, its blocks).
        self.wholes = [(slot, ctx, torch.tensor(blocks, dtype=torch.int64, device=device))
                       for slot, ctx, blocks in wholes]  # fmt: skip
        self.block_size = block_size
        self._masks: dict[int | None, torch.Tensor] = {}
        self._firsts: dict[int | None, torch.Tensor] = {}

    def fill(self, layer: int, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor) -> None:
        """Copy this step's new positions of every dense decode from the paged cache of ``layer``."""
        k_buf, v_buf = self.cache.k[layer], self.cache.v[layer]  # (slots, kvh, cap, hd)
        b, o = self.fill_blocks, self.fill_offsets
        if self.cache.kernels is not None:  # one call for both (the indexed copies below: the reference)
            self.cache.kernels.fill_slots_(k_buf, v_buf, k_cache_layer, v_cache_layer, self.fill_slots,
                                           self.fill_pos, b, o)  # fmt: skip
        else:
            k_buf[self.fill_slots, :, self.fill_pos] = k_cache_layer[b, o]  # (F, kvh, hd)
            v_buf[self.fill_slots, :, self.fill_pos] = v_cache_layer[b, o]
        kvh, hd = k_buf.shape[1], k_buf.shape[3]
        for slot, ctx, blocks in self.wholes:  # native: one pass (1k positions, 4 layers: 0.18 ms, not 0.55)
            if self.cache.kernels is not None:
                self.cache.kernels.fill_whole_(k_buf, v_buf, k_cache_layer, v_cache_layer, slot, ctx, blocks)
            else:  # the reference: one gather of its blocks, then one strided copy
                k_buf[slot, :, :ctx] = k_cache_layer[blocks].view(-1, kvh, hd)[:ctx].transpose(0, 1)
                v_buf[slot, :, :ctx] = v_cache_layer[blocks].view(-1, kvh, hd)[:ctx].transpose(0, 1)

    def _mask(self, window: int | None) -> torch.Tensor:
        """(width, 1, 1, span) bool mask: True where a slot's query sees the key."""
        mask = self._masks.get(window)
        if mask is None:
            pos = torch.arange(self.span, device=self.cache.device)[None, :]  # (1, span)
            lens = self.lens[:, None]  # (width, 1)
            seen = pos < lens  # (width, span)
            if window is not None:  # the query at position len-1 sees len-W .. len-1
                seen &= pos > lens - 1 - window
            mask = self._masks[window] = seen[:, None, None, :]
        return mask

    def _first(self, window: int | None) -> torch.Tensor:
        """(width,) int64: each slot's first key seen (0, or the window's start)."""
        first = self._firsts.get(window)
        if first is None:
            first = torch.zeros_like(self.lens) if window is None else (self.lens - window).clamp_(min=0)
            self._firsts[window] = first
        return first

    def attend(
        self, layer: int, q: torch.Tensor, out: torch.Tensor, scale: float, window: int | None,
        softcap: float | None = None,
    ) -> None:  # fmt: skip
        """Attention of the dense decodes' queries (rows of ``q``, (T, nh, hd)) into ``out``'s rows.

        One call over every slot: the G query heads sharing a KV head are that head's G query rows,
        so a slot is one (kvh, G, hd) x (kvh, span, hd) attention and no K/V is repeated. The call
        is the native kernel where the cache has it (``yutu.engine.native``), else torch's SDPA
        with a mask (the reference; a test holds the two together); ``softcap``: Gemma 2's cap on
        the scores, in the kernel, or written out around torch's (``yutu.engine.attention.sdpa``).
        """
        c = self.cache
        n, kvh, hd = self.width, c.num_kv_heads, q.shape[2]
        groups = q.shape[1] // kvh
        if self.aligned:  # slot i holds row i: q's rows are the slots, as they are
            qs = q[:n]
        else:
            qs = q.new_zeros((n, q.shape[1], hd))  # (width, nh, hd): holes stay zero
            qs[self.slots] = q[self.rows]
        k = c.k[layer][:n, :, : self.span]  # (width, kvh, span, hd), a view
        v = c.v[layer][:n, :, : self.span]
        if c.kernels is not None:
            o = c.kernels.dense_decode_attention(
                qs.view(n, kvh, groups, hd), k, v, self._first(window), self.lens, scale, softcap or 0.0
            )  # (width, kvh, G, hd)
        else:
            o = sdpa(
                qs.view(n, kvh, groups, hd), k, v, attn_mask=self._mask(window), scale=scale, softcap=softcap
            )  # (width, kvh, G, hd)
        o = o.reshape(n, -1, hd)  # a view where SDPA's output is contiguous (not always on CUDA)
        if self.aligned:
            out[:n] = o
        else:
            out[self.rows] = o[self.slots]  # (D, nh, hd)


class DenseDecodeCache:
    """Slots of decoding sequences in per-layer contiguous buffers. See the module docstring."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, budget_bytes: int,
                 dtype: torch.dtype, device: torch.device, kernels: ModuleType | None = None) -> None:  # fmt: skip
        if budget_bytes < 0:
            raise ValueError(f"the dense decode cache budget must be >= 0 bytes, got {budget_bytes}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_len, self.budget_bytes = max_len, budget_bytes
        self.dtype, self.device = dtype, device
        self.kernels = kernels  # the native kernels (yutu.engine.native); None: attend with torch's SDPA
        self.slots = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []  # per layer (slots, kvh, capacity, hd)
        self.v: list[torch.Tensor] = []
        self._owner: dict[str, int] = {}  # seq_id -> slot
        self._filled: dict[str, int] = {}  # seq_id -> positions 0 .. filled-1 copied
        self.grown = 0  # reallocations (for stats and tests)

    @property
    def token_bytes(self) -> int:
        """Bytes one position of one slot takes over all layers (K and V)."""
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.head_dim
            * torch.empty((), dtype=self.dtype).element_size()
        )

    def _fits(self, slots: int, capacity: int) -> bool:
        return slots * capacity * self.token_bytes <= self.budget_bytes

    def _grow(self, want_slots: int, want_capacity: int) -> None:
        """Make room for ``want_slots`` x ``want_capacity`` (doubling, within the budget), keeping the
        contents; when the budget cannot hold that, as much of it as fits (never shrinking)."""
        slots = _pow2_at_least(max(want_slots, self.slots, MIN_SLOTS))
        capacity = min(_pow2_at_least(max(want_capacity, self.capacity, MIN_CAPACITY)), self.max_len)
        capacity = max(capacity, self.capacity)
        per_slot = capacity * self.token_bytes
        if not self._fits(slots, capacity):  # fewer slots, then less capacity, never below today's
            slots = max(self.slots, min(slots, self.budget_bytes // per_slot))
        while not self._fits(slots, capacity) and capacity // 2 >= max(self.capacity, 1):
            capacity //= 2
            slots = max(self.slots, min(_pow2_at_least(max(want_slots, MIN_SLOTS)),
                                        self.budget_bytes // (capacity * self.token_bytes)))  # fmt: skip
        if slots == 0 or not self._fits(slots, capacity) or (slots, capacity) == (self.slots, self.capacity):
            return
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for new, old in ((k, self.k), (v, self.v)):
            for layer, buf in enumerate(old):
                new[layer][: self.slots, :, : self.capacity] = buf
        self.k, self.v, self.slots, self.capacity = k, v, slots, capacity
        self.grown += 1

    def plan(self, decodes: list[tuple[int, int, str, int, list[int]]], block_size: int) -> DenseStep | None:
        """The dense path of a step whose decodes are ``(seq_index, row, seq_id, context_len,
        block_table)``; frees the slots of sequences not among them. None: nothing runs dense."""
        present = {d[2] for d in decodes}
        for seq_id in [s for s in self._owner if s not in present]:
            del self._owner[seq_id], self._filled[seq_id]
        if not decodes or self.budget_bytes == 0:
            return None
        want_capacity = max(d[3] for d in decodes)
        if len(decodes) > self.slots or want_capacity > self.capacity:
            self._grow(len(decodes), want_capacity)
        free = sorted(set(range(self.slots)) - set(self._owner.values()), reverse=True)
        chosen: list[DenseDecode] = []
        fills: list[tuple[int, int, int, int]] = []
        wholes: list[tuple[int, int, list[int]]] = []
        for seq_index, row, seq_id, ctx, table in decodes:
            if ctx > self.capacity:
                self._owner.pop(seq_id, None)
                self._filled.pop(seq_id, None)
                continue  # the paged path takes it
            slot = self._owner.get(seq_id)
            if slot is None:
                if not free:
                    continue
                slot = self._owner[seq_id] = free.pop()
                self._filled[seq_id] = 0
            if self._filled[seq_id] == 0:
                wholes.append((slot, ctx, table[: -(-ctx // block_size)]))
            else:
                for pos in range(self._filled[seq_id], ctx):
                    fills.append((slot, pos, table[pos // block_size], pos % block_size))
            self._filled[seq_id] = ctx
            chosen.append(DenseDecode(seq_index, row, slot, ctx))
        if not chosen:
            return None
        return DenseStep(self, chosen, fills, wholes, block_size)

    def clear(self) -> None:
        """Forget every slot (the buffers stay allocated): the next steps fill them again."""
        self._owner.clear()
        self._filled.clear()

    @property
    def resident(self) -> int:
        """Sequences holding a slot."""
        return len(self._owner)
