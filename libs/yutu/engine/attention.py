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

import torch
import torch.nn.functional as F


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

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass
class _PrefillSpan:
    """One sequence whose chunk is attended on its own (chunk longer than one token)."""

    q_start: int  # first row of the chunk in the flat batch
    q_end: int  # one past its last row
    context_len: int  # keys to attend over (cached prefix + this chunk)
    block_ids: torch.Tensor  # (ceil(context_len / block_size),) int64
    mask: torch.Tensor | None  # (chunk, context_len) bool, True = attend; None = plain causal


@dataclass
class AttentionPlan:
    """Index tensors derived from one AttentionMetadata, built once per forward and shared by layers.

    Sequences with a one-token chunk (decode steps) are batched into one padded attention call;
    longer chunks (prefill) are attended one sequence at a time.
    """

    block_size: int
    sliding_window: int | None  # window the masks were built for, None: full attention
    write_blocks: torch.Tensor  # (T,) int64: cache block of each token of the batch
    write_offsets: torch.Tensor  # (T,) int64: offset of each token inside its block
    prefill: list[_PrefillSpan]
    decode_rows: torch.Tensor | None  # (D,) int64: rows of decode tokens in the flat batch
    decode_block_table: torch.Tensor | None  # (D, max_blocks) int64, padded with block 0
    decode_mask: torch.Tensor | None  # (D, 1, 1, max_blocks * block_size) bool, True = attend


def build_attention_plan(
    meta: AttentionMetadata, block_size: int, device: torch.device, sliding_window: int | None = None
) -> AttentionPlan:
    """Turn ``meta`` into the index tensors paged_attention needs, on ``device``.

    With ``sliding_window`` W a query at position p sees keys at positions p-W+1 .. p (the
    Hugging Face convention); without it, keys 0 .. p.
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
    decode_rows: list[int] = []
    decode_ctx: list[int] = []
    decode_tables: list[list[int]] = []
    for i, ctx in enumerate(meta.context_lens):
        q_start, q_end = meta.query_start[i], meta.query_start[i + 1]
        chunk = q_end - q_start
        num_blocks = -(-ctx // block_size)
        if not 0 < chunk <= ctx or len(meta.block_tables[i]) < num_blocks:
            raise ValueError(
                f"sequence {i}: chunk of {chunk} tokens, context {ctx}, {len(meta.block_tables[i])} blocks "
                f"(need 0 < chunk <= context and >= {num_blocks} blocks of {block_size})"
            )
        if chunk == 1:
            decode_rows.append(q_start)
            decode_ctx.append(ctx)
            decode_tables.append(meta.block_tables[i][:num_blocks])
            continue
        block_ids = torch.tensor(meta.block_tables[i][:num_blocks], dtype=torch.int64, device=device)
        mask = None
        if chunk != ctx or (sliding_window is not None and ctx > sliding_window):
            q_pos = torch.arange(ctx - chunk, ctx, device=device)[:, None]  # (chunk, 1)
            k_pos = torch.arange(ctx, device=device)[None, :]  # (1, ctx)
            mask = k_pos <= q_pos  # (chunk, ctx)
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        prefill.append(_PrefillSpan(q_start, q_end, ctx, block_ids, mask))

    decode_rows_t = decode_table_t = decode_mask_t = None
    if decode_rows:
        max_blocks = max(len(t) for t in decode_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        decode_rows_t = torch.tensor(decode_rows, dtype=torch.int64, device=device)  # (D,)
        decode_table_t = torch.tensor(padded, dtype=torch.int64, device=device)  # (D, max_blocks)
        ctx_t = torch.tensor(decode_ctx, dtype=torch.int64, device=device)[:, None]  # (D, 1)
        k_pos = torch.arange(max_blocks * block_size, device=device)[None, :]  # (1, S)
        mask = k_pos < ctx_t  # (D, S)
        if sliding_window is not None:
            mask &= k_pos >= ctx_t - sliding_window
        decode_mask_t = mask[:, None, None, :]  # (D, 1, 1, S)
    return AttentionPlan(
        block_size=block_size,
        sliding_window=sliding_window,
        write_blocks=slots // block_size,
        write_offsets=slots % block_size,
        prefill=prefill,
        decode_rows=decode_rows_t,
        decode_block_table=decode_table_t,
        decode_mask=decode_mask_t,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache_layer: torch.Tensor,
    v_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan | None = None,
) -> None:
    """Store this batch's keys and values at their slots.

    k, v: (T, num_kv_heads, head_dim); k_cache_layer, v_cache_layer: (num_blocks, block_size,
    num_kv_heads, head_dim) views of one layer of the KV cache (e.g. ``kv_cache[:, layer, 0]``).
    """
    if plan is not None:
        blocks, offsets = plan.write_blocks, plan.write_offsets  # (T,), (T,)
    else:
        block_size = k_cache_layer.shape[1]
        slots = slot_mapping.to(device=k.device, dtype=torch.int64)  # (T,)
        blocks, offsets = slots // block_size, slots % block_size  # (T,), (T,)
    k_cache_layer[blocks, offsets] = k  # (T, kvh, hd) scattered into (num_blocks, block_size, kvh, hd)
    v_cache_layer[blocks, offsets] = v


def paged_attention(
    q: torch.Tensor,
    k_cache_layer: torch.Tensor,
    v_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk over its whole cached context.

    q: (T, num_heads, head_dim), already rotated; the chunk's own K/V must already be in the cache
    (write_kv_cache). Caches: (num_blocks, block_size, num_kv_heads, head_dim). Returns
    (T, num_heads, head_dim). ``plan`` (from build_attention_plan) saves rebuilding the index tensors
    in every layer; when given, its sliding window is used.
    """
    block_size = k_cache_layer.shape[1]
    if plan is None:
        plan = build_attention_plan(meta, block_size, q.device, sliding_window)
    num_kv_heads, head_dim = k_cache_layer.shape[2], k_cache_layer.shape[3]
    out = torch.empty_like(q)  # (T, nh, hd)

    # Prefill chunks, one sequence at a time: chunk rows a = 0..n-1 sit at positions ctx-n+a.
    for span in plan.prefill:
        ctx = span.context_len
        k = k_cache_layer[span.block_ids].reshape(-1, num_kv_heads, head_dim)[:ctx]  # (ctx, kvh, hd)
        v = v_cache_layer[span.block_ids].reshape(-1, num_kv_heads, head_dim)[:ctx]  # (ctx, kvh, hd)
        qs = q[span.q_start : span.q_end].transpose(0, 1)[None]  # (1, nh, n, hd)
        o = F.scaled_dot_product_attention(
            qs,
            k.transpose(0, 1)[None],  # (1, kvh, ctx, hd)
            v.transpose(0, 1)[None],  # (1, kvh, ctx, hd)
            attn_mask=span.mask,  # (n, ctx) or None
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=True,
        )  # (1, nh, n, hd)
        out[span.q_start : span.q_end] = o[0].transpose(0, 1)  # (n, nh, hd)

    # Decode steps, all at once: pad every block table to the longest, mask the padding.
    if plan.decode_rows is not None:
        assert plan.decode_block_table is not None and plan.decode_mask is not None
        num_dec, max_blocks = plan.decode_block_table.shape
        span_len = max_blocks * block_size
        k = k_cache_layer[plan.decode_block_table]  # (D, max_blocks, bs, kvh, hd)
        v = v_cache_layer[plan.decode_block_table]  # (D, max_blocks, bs, kvh, hd)
        k = k.reshape(num_dec, span_len, num_kv_heads, head_dim).transpose(1, 2)  # (D, kvh, S, hd)
        v = v.reshape(num_dec, span_len, num_kv_heads, head_dim).transpose(1, 2)  # (D, kvh, S, hd)
        qd = q[plan.decode_rows][:, :, None, :]  # (D, nh, 1, hd)
        o = F.scaled_dot_product_attention(
            qd, k, v, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
        )  # (D, nh, 1, hd)
        out[plan.decode_rows] = o[:, :, 0, :]  # (D, nh, hd)
    return out
