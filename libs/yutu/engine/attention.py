"""Paged attention over the block-structured KV cache.

KV cache layout (one tensor per engine, allocated by the model runner):

    kv_cache: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)

so ``kv_cache[b]`` -- one block of all layers, K and V -- is contiguous and is exactly one store
object (see DESIGN.md, "Store object"). Token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``; its flat *slot* is
``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from yutu.engine.decode_cache import DenseStep


@dataclass
class AttentionMetadata:
    """Where the tokens of one forward pass come from and where their K/V go.

    The batch is a flat run of ``T`` tokens made of ``S`` sequences laid end to end::

        tokens:  [ seq0 chunk | seq1 chunk | ... | seq{S-1} chunk ]
                 ^query_start[0]  ^query_start[1]               ^query_start[S] == T

    A sequence's chunk is its next ``query_start[i+1] - query_start[i]`` tokens: a prefill chunk or a
    single decode token. ``context_lens[i]`` counts every token of sequence ``i`` in the cache once this
    pass has written its chunk (cached prefix + earlier chunks + this chunk), so the chunk's tokens sit
    at positions ``context_lens[i] - chunk_len ... context_lens[i] - 1``.
    """

    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot for each token of the batch
    query_start: list[int]  # (S+1,) cumulative chunk offsets into the flat batch
    context_lens: list[int]  # (S,) tokens in cache per sequence after this pass
    block_tables: list[list[int]]  # (S, *) block ids per sequence, covering context_lens[i]
    dense: DenseStep | None = None  # decodes attended on the dense decode cache (yutu.engine.decode_cache)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass
class _PrefillSpan:
    """One sequence whose chunk is attended on its own (chunk longer than one token)."""

    q_start: int  # first row of the chunk in the flat batch
    q_end: int  # one past its last row
    key_start: int  # position of the first key gathered (> 0 only under a sliding window)
    context_len: int  # one past the position of the last key (cached prefix + this chunk)
    block_ids: torch.Tensor  # (num_gathered_blocks,) int64: blocks holding keys key_start .. context_len-1
    sliding_window: int | None

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """(chunk, context_len - key_start) bool, True = attend; None = plain causal. Built when first
        read: torch's path reads it, the native kernel masks by itself (a 1,024-token chunk's mask
        after a cached prefix took 0.4-0.6 ms a forward)."""
        chunk, ctx, window = self.q_end - self.q_start, self.context_len, self.sliding_window
        if chunk == ctx and (window is None or ctx <= window):
            return None
        device = self.block_ids.device
        q_pos = torch.arange(ctx - chunk, ctx, device=device)[:, None]  # (chunk, 1)
        k_pos = torch.arange(self.key_start, ctx, device=device)[None, :]  # (1, ctx - key_start)
        mask = k_pos <= q_pos  # (chunk, ctx - key_start)
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask


@dataclass
class _DecodeGroup:
    """Sequences with one-token chunks, attended together in one padded call."""

    rows: torch.Tensor  # (D,) int64: rows of their tokens in the flat batch
    block_table: torch.Tensor  # (D, max_blocks) int64, padded with block 0
    mask: torch.Tensor  # (D, 1, 1, max_blocks * block_size) bool, True = attend


@dataclass
class AttentionPlan:
    """Index tensors derived from one AttentionMetadata, built once per forward and shared by layers.

    Sequences with a one-token chunk (decode steps) are batched into padded attention calls, in
    groups of similar context length; longer chunks (prefill) are attended one sequence at a time.
    """

    block_size: int
    sliding_window: int | None  # window the masks were built for, None: full attention
    write_blocks: torch.Tensor  # (T,) int64: cache block of each token of the batch
    write_offsets: torch.Tensor  # (T,) int64: offset of each token inside its block
    prefill: list[_PrefillSpan]
    decode: list[_DecodeGroup]


def build_attention_plan(
    meta: AttentionMetadata,
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    max_decode_group_tokens: int | None = None,
) -> AttentionPlan:
    """Turn ``meta`` into the index tensors paged_attention needs, on ``device``.

    With ``sliding_window`` W a query at position p sees keys at positions p-W+1 .. p (the
    Hugging Face convention), and blocks wholly before the window are not read; without it, keys
    0 .. p. Decode sequences are sorted by context length and grouped so that a group's padded
    key count (sequences x longest context) stays within ``max_decode_group_tokens`` (None: one
    group) -- on CPU, small groups keep the gathered keys in cache.
    """
    slots = meta.slot_mapping.to(device=device, dtype=torch.int64)  # (T,)
    if len(meta.query_start) != meta.num_seqs + 1 or len(meta.block_tables) != meta.num_seqs:
        raise ValueError(
            f"AttentionMetadata is inconsistent: {meta.num_seqs} context_lens, "
            f"{len(meta.query_start)} query_start entries (need S+1), {len(meta.block_tables)} block tables"
        )
    if meta.query_start[-1] != slots.shape[0]:
        raise ValueError(
            f"query_start ends at {meta.query_start[-1]} but slot_mapping has {slots.shape[0]} tokens"
        )
    prefill: list[_PrefillSpan] = []
    decode: list[tuple[int, int, int, list[int]]] = []  # (row, key_start, context_len, block ids)
    for i, ctx in enumerate(meta.context_lens):
        q_start, q_end = meta.query_start[i], meta.query_start[i + 1]
        chunk = q_end - q_start
        num_blocks = -(-ctx // block_size)
        if not 0 < chunk <= ctx or len(meta.block_tables[i]) < num_blocks:
            raise ValueError(
                f"sequence {i}: chunk of {chunk} tokens, context {ctx}, {len(meta.block_tables[i])} blocks "
                f"(need 0 < chunk <= context and >= {num_blocks} blocks of {block_size})"
            )
        # The chunk's first query sits at ctx - chunk; under a window it sees nothing before
        # ctx - chunk - W + 1, so start at the block holding that position.
        first_key = 0 if sliding_window is None else max(0, ctx - chunk - sliding_window + 1)
        first_block = first_key // block_size
        key_start = first_block * block_size
        table = meta.block_tables[i][first_block:num_blocks]
        if chunk == 1:
            if meta.dense is None or i not in meta.dense.seq_indices:
                decode.append((q_start, key_start, ctx, table))
            continue
        block_ids = torch.tensor(table, dtype=torch.int64, device=device)
        prefill.append(_PrefillSpan(q_start, q_end, key_start, ctx, block_ids, sliding_window))

    groups: list[_DecodeGroup] = []
    decode.sort(key=lambda d: len(d[3]), reverse=True)  # longest first: each group's first is its longest
    start = 0
    while start < len(decode):
        group_blocks = len(decode[start][3])
        end = start + 1
        while end < len(decode) and (
            max_decode_group_tokens is None
            or (end + 1 - start) * group_blocks * block_size <= max_decode_group_tokens
        ):
            end += 1
        members = decode[start:end]
        start = end
        rows = torch.tensor([m[0] for m in members], dtype=torch.int64, device=device)  # (D,)
        padded = [m[3] + [0] * (group_blocks - len(m[3])) for m in members]
        table_t = torch.tensor(padded, dtype=torch.int64, device=device)  # (D, max_blocks)
        key_start_t = torch.tensor([m[1] for m in members], dtype=torch.int64, device=device)[
            :, None
        ]  # (D, 1)
        ctx_t = torch.tensor([m[2] for m in members], dtype=torch.int64, device=device)[:, None]  # (D, 1)
        k_pos = key_start_t + torch.arange(group_blocks * block_size, device=device)[None, :]  # (D, S)
        mask = k_pos < ctx_t  # (D, S)
        if sliding_window is not None:
            mask &= k_pos > ctx_t - 1 - sliding_window
        groups.append(_DecodeGroup(rows, table_t, mask[:, None, None, :]))  # mask (D, 1, 1, S)
    return AttentionPlan(
        block_size=block_size,
        sliding_window=sliding_window,
        write_blocks=slots // block_size,
        write_offsets=slots % block_size,
        prefill=prefill,
        decode=groups,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache_layer: torch.Tensor,
    v_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan | None = None,
    ops: ModuleType | None = None,
) -> None:
    """Store this batch's keys and values at their slots.

    k, v: (T, num_kv_heads, head_dim); k_cache_layer, v_cache_layer: (num_blocks, block_size,
    num_kv_heads, head_dim) views of one layer of the KV cache (e.g. ``kv_cache[:, layer, 0]``).
    ``ops``: the native kernels (one call for both; torch's indexed assignment is the reference).
    """
    if ops is not None and plan is not None:
        ops.write_kv_(k_cache_layer, v_cache_layer, k, v, plan.write_blocks, plan.write_offsets)
        return
    if plan is not None:
        blocks, offsets = plan.write_blocks, plan.write_offsets  # (T,), (T,)
    else:
        block_size = k_cache_layer.shape[1]
        slots = slot_mapping.to(device=k.device, dtype=torch.int64)  # (T,)
        blocks, offsets = slots // block_size, slots % block_size  # (T,), (T,)
    k_cache_layer[blocks, offsets] = k  # (T, kvh, hd) scattered into (num_blocks, block_size, kvh, hd)
    v_cache_layer[blocks, offsets] = v


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """torch's scaled dot-product attention, q (..., H, n, hd) over k, v (..., Hk, S, hd); with
    ``softcap`` (Gemma 2) the same attention written out, as transformers' eager Gemma 2 computes
    it: scores ``softcap * tanh(q.k * scale / softcap)``, masked (``attn_mask`` bool, True where a
    query sees a key; ``is_causal``: the last n of S keys, one more per query), softmax in float32,
    weights in q's dtype times v."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # query head h reads KV head h // G (repeat_kv)
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., H, n, S)
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, s = scores.shape[-2:]
        attn_mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)  # (..., H, n, hd)


def paged_attention(
    q: torch.Tensor,
    k_cache_layer: torch.Tensor,
    v_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
    ops: ModuleType | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk over its whole cached context.

    q: (T, num_heads, head_dim), already rotated; the chunk's own K/V must already be in the cache
    (write_kv_cache). Caches: (num_blocks, block_size, num_kv_heads, head_dim). Returns
    (T, num_heads, head_dim). ``plan`` (from build_attention_plan) saves rebuilding the index tensors
    in every layer; when given, its sliding window is used. ``ops``: the native kernels, which
    attend the prefill chunks (with the window, if any, in the kernel); torch's SDPA is the reference.
    ``softcap``: Gemma 2's cap on the scores (see :func:`sdpa`; the native kernel caps them too).
    """
    block_size = k_cache_layer.shape[1]
    if plan is None:
        plan = build_attention_plan(meta, block_size, q.device, sliding_window)
    num_kv_heads, head_dim = k_cache_layer.shape[2], k_cache_layer.shape[3]
    out = torch.empty_like(q)  # (T, nh, hd)

    # Prefill chunks, one sequence at a time: chunk rows a = 0..n-1 sit at positions ctx-n+a.
    for span in plan.prefill:
        n_keys = span.context_len - span.key_start
        k = k_cache_layer[span.block_ids].view(-1, num_kv_heads, head_dim)[:n_keys]  # (n_keys, kvh, hd)
        v = v_cache_layer[span.block_ids].view(-1, num_kv_heads, head_dim)[:n_keys]  # (n_keys, kvh, hd)
        if ops is not None:  # rows at the keys' end (those before the window's first block not gathered)
            out[span.q_start : span.q_end] = ops.prefill_attention(
                q[span.q_start : span.q_end], k, v, scale, softcap or 0.0, plan.sliding_window or 0
            )
            continue
        qs = q[span.q_start : span.q_end].transpose(0, 1)[None]  # (1, nh, n, hd)
        o = sdpa(
            qs,
            k.transpose(0, 1)[None],  # (1, kvh, n_keys, hd)
            v.transpose(0, 1)[None],  # (1, kvh, n_keys, hd)
            attn_mask=span.mask,  # (n, n_keys) or None
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=True,
            softcap=softcap,
        )  # (1, nh, n, hd)
        out[span.q_start : span.q_end] = o[0].transpose(0, 1)  # (n, nh, hd)

    # Decode steps, a group at a time: block tables padded to the group's longest, padding masked.
    for group in plan.decode:
        num_dec, max_blocks = group.block_table.shape
        span_len = max_blocks * block_size
        flat_table = group.block_table.view(-1)  # (D * max_blocks,): 1-D indexing gathers faster
        k = k_cache_layer[flat_table].view(num_dec, span_len, num_kv_heads, head_dim)  # (D, S, kvh, hd)
        v = v_cache_layer[flat_table].view(num_dec, span_len, num_kv_heads, head_dim)  # (D, S, kvh, hd)
        # A KV head's G query heads as its G query rows: (D, kvh, G, hd) against (D, kvh, S, hd),
        # no K/V repeated (as the dense path does; one query row each with enable_gqa was 2x slower).
        qg = q[group.rows].view(num_dec, num_kv_heads, -1, head_dim)  # (D, kvh, G, hd)
        o = sdpa(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask, scale=scale, softcap=softcap
        )  # (D, kvh, G, hd)
        out[group.rows] = o.reshape(num_dec, -1, head_dim)  # (D, nh, hd)
    return out
