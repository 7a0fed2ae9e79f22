"""The model runner: owns the KV cache tensor and turns a ScheduledBatch into logits.

One forward pass per step over the flat batch (see ``yutu.engine.attention``)::

    input_ids: [ chunk0 tokens | chunk1 tokens | ... ]   (T,)
    positions: [ start0 .. end0-1 | start1 .. end1-1 | ... ]
    logits:    rows at the last token of every chunk with ``sample`` set, in chunk order (R, V)
    hidden:    every row of the chunks the caller names (their prompt logprobs: yutu.engine.engine)

Not thread-safe: one engine thread owns it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from yutu.engine.attention import AttentionMetadata
from yutu.engine.decode_cache import DenseDecodeCache
from yutu.engine.model_config import ModelConfig
from yutu.engine.scheduler import ScheduledBatch


class CausalLM(Protocol):
    """What the runner needs from a model (``yutu.engine.model.LlamaForCausalLM`` fits)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of all layers (one store object) in ``dtype``."""
    return config.kv_block_numel(block_size) * torch.empty((), dtype=dtype).element_size()


KVCacheFactory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Builds the KV cache tensor of a shape and dtype (e.g. a view over registered shared memory)."""

# The attention backends a step may use on CUDA: torch's own order without cuDNN. With a mask and
# bfloat16 on a Hopper GPU, torch (2.11 and later) tries cuDNN first, which builds an execution plan
# for every new shape -- and a serving engine's shapes change every step (a decode's context grows
# by one token). Measured on an H200 (loadtests/gpu_check.sh, the demo model, bfloat16): with cuDNN a
# batch-1 decode step took 9.7 ms and a 1,024-token prompt 84 ms, against 2.7 and 5.2 in float32,
# which cuDNN does not serve.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ModelRunner:
    """Owns ``kv_cache`` (num_blocks, num_layers, 2, block_size, kvh, hd) and runs the model.

    The cache is zero-filled device memory, or whatever ``kv_cache_factory`` returns: a worker
    that lends its blocks to peers passes a view over a transfer-engine region, so block ``b`` is
    the byte range ``[b * block_bytes, (b + 1) * block_bytes)`` of that region.
    """

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_factory: KVCacheFactory | None = None,
        *,
        dense_decode_bytes: int = 0,
        max_model_len: int | None = None,
        kernels: ModuleType | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        shape = config.kv_cache_shape(num_blocks, block_size)
        if kv_cache_factory is None:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        else:
            cache = kv_cache_factory(shape, dtype)
            if tuple(cache.shape) != shape or cache.dtype != dtype or cache.device != device:
                raise ValueError(
                    f"kv_cache_factory returned {tuple(cache.shape)} {cache.dtype} on {cache.device};"
                    f" the engine needs {shape} {dtype} on {device}"
                )
            if not cache.is_contiguous():
                raise ValueError(
                    "kv_cache_factory must return a contiguous tensor (block b at b * block_bytes)"
                )
            self.kv_cache = cache
        self.dense: DenseDecodeCache | None = None
        self.last_hidden: dict[int, torch.Tensor] = {}  # see run()
        if dense_decode_bytes > 0:
            self.dense = DenseDecodeCache(
                config.num_layers, config.num_kv_heads, config.head_dim,
                max_model_len or num_blocks * block_size, dense_decode_bytes, dtype, device, kernels,
            )  # fmt: skip

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten ``batch`` into (input_ids (T,), positions (T,), metadata, rows to sample)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        for chunk in batch.chunks:
            table = chunk.block_table
            assert len(table) * bs >= chunk.context_len, (chunk.seq_id, len(table), chunk.context_len)
            input_ids.extend(chunk.token_ids)
            chunk_positions = range(chunk.start, chunk.context_len)
            positions.extend(chunk_positions)
            slots.extend(table[p // bs] * bs + p % bs for p in chunk_positions)
            query_start.append(len(input_ids))
            if chunk.sample:
                sample_rows.append(len(input_ids) - 1)
        dense = None
        if self.dense is not None:
            decodes = [(i, query_start[i], c.seq_id, c.context_len, c.block_table)
                       for i, c in enumerate(batch.chunks) if c.num_tokens == 1]  # fmt: skip
            dense = self.dense.plan(decodes, bs)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start=query_start,
            context_lens=[c.context_len for c in batch.chunks],
            block_tables=[c.block_table for c in batch.chunks],
            dense=dense,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta, sample_rows

    def run(self, batch: ScheduledBatch, hidden_of: Collection[int] = ()) -> torch.Tensor:
        """Compute ``batch``, writing its K/V into the cache; return (R, V) float32 logits, R = sampled
        chunks. The hidden states of every row of the chunks numbered in ``hidden_of`` are kept in
        ``last_hidden`` (chunk number -> (n, H)) until the next call."""
        ids, pos, meta, sample_rows = self.prepare(batch)
        self.last_hidden = {}
        try:
            return self._forward(ids, pos, meta, sample_rows, hidden_of)
        except BaseException:
            if self.dense is not None:  # a step cut short may have filled slots halfway
                self.dense.clear()
            raise

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: list[int],
        hidden_of: Collection[int],
    ) -> torch.Tensor:
        backends = sdpa_kernel(CUDA_SDPA_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), backends:
            hidden = self.model(ids, pos, self.kv_cache, meta)  # (T, H)
            for i in hidden_of:
                self.last_hidden[i] = hidden[meta.query_start[i] : meta.query_start[i + 1]]
            if not sample_rows:
                return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            return self.model.compute_logits(hidden[rows]).float()  # (R, V)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 logits of hidden states ``hidden`` (n, H) (from ``last_hidden``)."""
        with torch.inference_mode():
            return self.model.compute_logits(hidden).float()
