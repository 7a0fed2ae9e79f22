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
