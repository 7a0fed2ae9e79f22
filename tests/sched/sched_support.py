"""Builders for scripted snapshots, with cost models whose numbers are exact in binary floating point.

The test cost models (priors only: no test here feeds them, so they never refit):
- prefill: 2**-10 s per new token (PREFILL_PER_TOKEN), nothing else, so a block of 16 tokens costs
  2**-6 s to compute;
- transfer: 2**-7 s latency and 2**-7 s per 1000-byte block (bandwidth 128000 B/s), so fetching k
  blocks costs (k + 1) * 2**-7 s: one block costs exactly what it saves (recompute wins the tie),
  two or more pay;
- decode step: 2**-7 s + 2**-10 s per sequence (KV tokens free).
"""

from __future__ import annotations

from typing import Any

from yutu.sched import (
    ClusterView,
    CostModels,
    DecodeCostModel,
    DecodeView,
    PrefillCostModel,
    PrefillView,
    RequestView,
    TransferCostModel,
)

BS = 16
BYTES_PER_BLOCK = 1000
PREFILL_PER_TOKEN = 2.0**-10
TRANSFER_LATENCY = 2.0**-7
TRANSFER_PER_BLOCK = 2.0**-7
STEP_BASE = 2.0**-7
STEP_PER_SEQ = 2.0**-10
PROMPT = 161  # 10 full blocks and 1 token: 10 usable prefix blocks, at least 1 token computed


def costs() -> CostModels:
    return CostModels(
        prefill=PrefillCostModel((0.0, PREFILL_PER_TOKEN, 0.0), trusted=True),
        transfer=TransferCostModel(BYTES_PER_BLOCK / TRANSFER_PER_BLOCK, latency_s=TRANSFER_LATENCY),
        decode=DecodeCostModel((STEP_BASE, STEP_PER_SEQ, 0.0), trusted=True),
    )


def keys(n: int, tag: str = "k") -> tuple[str, ...]:
    return tuple(f"{tag}{i:02d}" for i in range(n))


KEYS = keys(PROMPT // BS)


def request(prompt_len: int = PROMPT, max_tokens: int = 8, rid: str = "r1") -> RequestView:
    return RequestView(rid, keys(prompt_len // BS), prompt_len, max_tokens)


def held(n: int) -> frozenset[str]:
    """A cache holding the first ``n`` blocks of the standard prompt."""
    return frozenset(KEYS[:n])


def prefill(pid: str, local: int = 0, free: int = 1000, **kw: Any) -> PrefillView:
    return PrefillView(pid, held(local), free, **kw)


def decode(did: str, free: int = 1000, max_batch: int = 64, **kw: Any) -> DecodeView:
    return DecodeView(did, free, max_batch, **kw)


def cluster(
    prefills: tuple[PrefillView, ...] = (),
    decodes: tuple[DecodeView, ...] = (),
    store: int | frozenset[str] = 0,
) -> ClusterView:
    held_by_store = held(store) if isinstance(store, int) else store
    return ClusterView(prefills, decodes, held_by_store, BYTES_PER_BLOCK, BS)


def prefill_time(new_tokens: int) -> float:
    return new_tokens * PREFILL_PER_TOKEN


def transfer_time(blocks: int) -> float:
    return TRANSFER_LATENCY + blocks * TRANSFER_PER_BLOCK


def step(batch: int) -> float:
    return STEP_BASE + batch * STEP_PER_SEQ
