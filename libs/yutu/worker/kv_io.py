"""Moving KV blocks into this worker's cache: from a peer's segment, or from the KV store.

A worker's KV cache is one registered region (see :mod:`yutu.worker.kv_region`); block ``b`` is
the byte range ``[b * block_bytes, (b + 1) * block_bytes)``. Pulling a request's blocks from a
prefill instance is one batched READ of the transfer engine, with adjacent blocks merged into one
request when they are adjacent on both sides::

    pairs (local, remote):  (7, 3) (8, 4) (9, 5) (2, 9)
    runs:                   local 7..9 <- remote 3..5 (3 blocks) | local 2 <- remote 9 (1 block)

Both functions report how many *leading* blocks arrived: a block after a failed one is useless
(its prefix would be missing), so the caller recomputes from the first failure on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from yutu.errors import YutuError
from yutu.store.client import StoreClient
from yutu.transfer import TransferEngine, TransferError, TransferOp, TransferRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockRun:
    """``count`` consecutive blocks: local ``local_start..`` <- remote ``remote_start..``."""

    local_start: int
    remote_start: int
    count: int
    first_pair: int  # index in the caller's pair list of this run's first block


def block_runs(pairs: Sequence[tuple[int, int]]) -> list[BlockRun]:
    """Merge (local block, remote block) pairs, in order, into runs consecutive on both sides."""
    runs: list[BlockRun] = []
    for i, (local, remote) in enumerate(pairs):
        last = runs[-1] if runs else None
        if (
            last is not None
            and local == last.local_start + last.count
            and remote == last.remote_start + last.count
        ):
            runs[-1] = BlockRun(last.local_start, last.remote_start, last.count + 1, last.first_pair)
        else:
            runs.append(BlockRun(local, remote, 1, i))
    return runs


async def pull_blocks(
    engine: TransferEngine,
    local_region: str,
    remote_segment: str,
    remote_region: str,
    pairs: Sequence[tuple[int, int]],
    block_bytes: int,
    timeout_s: float | None = None,
) -> int:
    """READ every remote block of ``pairs`` into its local block; returns how many leading pairs
    arrived (``len(pairs)`` when all did). Never raises for a failed transfer: it is logged."""
    if not pairs:
        return 0
    runs = block_runs(pairs)
    requests = [
        TransferRequest(
            TransferOp.READ,
            local_region,
            run.local_start * block_bytes,
            remote_segment,
            remote_region,
            run.remote_start * block_bytes,
            run.count * block_bytes,
        )
        for run in runs
    ]
    try:
        results = await engine.transfer(requests, timeout_s)
    except (TransferError, ValueError) as exc:  # e.g. this engine is closing
        log.warning("pulling %d KV blocks from %s failed: %s", len(pairs), remote_segment, exc)
        return 0
    for run, result in zip(runs, results, strict=True):
        if not result.ok:
            log.warning(
                "pulling KV blocks %d..%d from %s failed: %s",
                run.remote_start,
                run.remote_start + run.count - 1,
                remote_segment,
                result.error,
            )
            return run.first_pair
    return len(pairs)


async def fetch_from_store(
    store: StoreClient, region: str, keys: Sequence[str], block_ids: Sequence[int], block_bytes: int
) -> int:
    """Copy the store objects ``keys`` into blocks ``block_ids`` (one batched ``get_into``); returns
    how many leading keys arrived whole. A missing key (evicted since it was planned) ends the run."""
    if not keys:
        return 0
    try:
        sizes = await store.get_into_batch(list(keys), region, [b * block_bytes for b in block_ids])
    except YutuError as exc:
        log.warning("fetching %d KV blocks from the store failed: %s", len(keys), exc)
        return 0
    for i, size in enumerate(sizes):
        if size != block_bytes:
            if size is not None:
                log.warning(
                    "store object %s has %d bytes, a KV block %d: not reused", keys[i], size, block_bytes
                )
            return i
    return len(keys)
