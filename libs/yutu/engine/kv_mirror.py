"""The KV cache of an engine on a GPU, and its host copy that peers and the store read and write.

A worker's KV cache is a transfer-engine region: host memory that peers read (a prefill's held
prompt, pulled by a decode instance), write (an import from a peer or the store) and the store's
write-behind puts from. An engine on the CPU computes in that region directly. An engine on a GPU
computes in device memory, and the region becomes the cache's *host mirror*, block for block (the
same shape), kept in step at the three moments a block changes hands:

- a prefill-only request's blocks are held for a peer: device -> host, before its output says so;
- blocks are committed to the prefix cache (``stored`` events, which the write-behind puts from):
  device -> host, before the events are taken;
- imported blocks are filled (``finish_load``): host -> device, before the request runs.

Nothing else reads or writes the host copy, so between those moments the two may differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVMirror:
    """``device`` (the cache the model computes in) and ``host`` (its copy in shared host memory)."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        if device.shape != host.shape or device.dtype != host.dtype:
            raise ValueError(
                f"the host mirror is {tuple(host.shape)} {host.dtype}; the cache is {tuple(device.shape)}"
                f" {device.dtype}"
            )
        if host.device.type != "cpu":
            raise ValueError(f"the host mirror must be in host memory, got {host.device}")
        self.device = device
        self.host = host

    def to_host(self, block_ids: Sequence[int]) -> None:
        """Copy blocks ``block_ids`` of the device cache into the host copy."""
        if block_ids:
            rows = torch.tensor(block_ids, dtype=torch.long)
            blocks = self.device.index_select(0, rows.to(self.device.device)).to("cpu")
            self.host.index_copy_(0, rows, blocks)

    def from_host(self, block_ids: Sequence[int]) -> None:
        """Copy blocks ``block_ids`` of the host copy into the device cache."""
        if block_ids:
            rows = torch.tensor(block_ids, dtype=torch.long)
            blocks = self.host.index_select(0, rows).to(self.device.device)
            self.device.index_copy_(0, rows.to(self.device.device), blocks)
