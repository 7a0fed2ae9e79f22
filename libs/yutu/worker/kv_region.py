"""The engine's KV cache in registered memory.

A worker's cache tensor ``(num_blocks, layers, 2, block_size, kv_heads, head_dim)`` is a torch
view over one region of the worker's transfer engine, so peers read or write block ``b`` at byte
offset ``b * block_bytes`` of that region with the transfer engine, with no staging copy: the
decode pulls a prefill's blocks with one batched READ, and the store client puts and gets blocks
straight from and into the cache. KV bytes never ride in a control message.

The engine decides how many blocks fit its memory budget; it calls :meth:`KVRegion.factory` once
with the final shape, which registers the region and returns the view.
"""

from __future__ import annotations

import math

import torch

from yutu.transfer import Region, TransferEngine

KV_REGION = "kv"


class KVRegion:
    def __init__(self, engine: TransferEngine, name: str = KV_REGION) -> None:
        self.engine = engine
        self.name = name
        self.region: Region | None = None
        self.block_bytes = 0
        self.num_blocks = 0

    def factory(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Register the region for a cache of ``shape`` and ``dtype``; return the tensor over it."""
        return self.register(shape, dtype).view_torch(dtype, shape)

    def register(self, shape: tuple[int, ...], dtype: torch.dtype | str) -> Region:
        """Register the region for a cache of ``shape`` and ``dtype`` (a torch dtype or its name,
        e.g. ``"bfloat16"``) without a tensor over it: an engine process maps its file itself."""
        if self.region is not None:
            raise RuntimeError(f"the KV region {self.name!r} is already registered")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
            assert isinstance(dtype, torch.dtype), f"not a torch dtype: {dtype!r}"
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.num_blocks = shape[0]
        self.block_bytes = math.prod(shape[1:]) * itemsize
        self.region = self.engine.register_region(self.name, self.num_blocks * self.block_bytes)
        return self.region

    def offset(self, block_id: int) -> int:
        return block_id * self.block_bytes
