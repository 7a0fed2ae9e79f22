"""A Mooncake trace turned into the token-id requests a replay sends, and the cache they could reuse.

Pure code (no I/O but reading the trace file, no clock): ``replay.py`` drives it, tests check it.

A Mooncake FAST'25 trace is JSON Lines, one request per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 2353, 2354, 2355, 2356, 2357]}

``timestamp`` is the arrival in ms from the start of the trace; each hash id stands for one
512-token block *and every block before it*, so equal leading ids mean a shared prefix; the last
block may be partial (``len(hash_ids) == ceil(input_length / 512)``).

Scaling. Real prompts do not fit a small model, so every 512-token trace block becomes
``block_tokens`` tokens, and lengths shrink by the same factor ``s = block_tokens / 512``::

    trace  | block h0 (512) | block h1 (512) | h2 (partial: 300) |   input_length = 1324
    wire   | h0 (64)        | h1 (64)        | h2 (38)           |   ceil(1324 * s) = 166

Each block's ids come from a generator seeded by ``(seed, hash_id)``, so equal ids give equal
tokens and shared prefixes in the trace are shared prefixes on the wire. ``max_tokens`` is the
output length times ``output_scale`` (by default ``s`` as well), at least 1. A request longer than
``max_model_len`` loses the tail of its prompt (whole tail blocks, then tokens of the last kept
one) until ``prompt + max_tokens`` fits; the tokens cut are counted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace, as recorded."""

    line: int  # 0-based line number in the trace file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace_line(text: str, line: int) -> TraceRequest:
    """One trace line; ``ValueError`` naming the line when it is not a Mooncake record."""
    try:
        rec = json.loads(text)
        req = TraceRequest(
            line=line,
            timestamp_ms=float(rec["timestamp"]),
            input_length=int(rec["input_length"]),
            output_length=int(rec["output_length"]),
            hash_ids=tuple(int(h) for h in rec["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"trace line {line + 1} is not a Mooncake record "
            f'{{"timestamp", "input_length", "output_length", "hash_ids"}}: {exc}'
        ) from exc
    blocks = math.ceil(req.input_length / TRACE_BLOCK_TOKENS)
    if req.input_length < 1 or len(req.hash_ids) != blocks or min(req.hash_ids) < 0:
        raise ValueError(
            f"trace line {line + 1}: input_length {req.input_length} needs {blocks} non-negative hash ids "
            f"(one per {TRACE_BLOCK_TOKENS}-token block), got {len(req.hash_ids)}"
        )
    if req.output_length < 0:
        raise ValueError(f"trace line {line + 1}: output_length must be >= 0, got {req.output_length}")
    return req


def read_trace(path: Path, start: int = 0, limit: int | None = None) -> list[TraceRequest]:
    """Lines ``[start, start + limit)`` of the trace at ``path`` (all from ``start`` if no limit)."""
    if not path.is_file():
        raise ValueError(f"trace file {path} does not exist: pass the path of a Mooncake .jsonl trace")
    with path.open() as f:
        numbered = ((i, text) for i, text in enumerate(f) if text.strip())
        stop = None if limit is None else start + limit
        return [parse_trace_line(text, i) for i, text in islice(numbered, start, stop)]


@dataclass(frozen=True)
class Synthesis:
    """How trace requests become wire requests (see the module docstring)."""

    vocab_size: int  # token ids are drawn from [min_token_id, vocab_size)
    max_model_len: int  # prompt + max_tokens never exceed it
    block_tokens: int = 64  # tokens per 512-token trace block
    min_token_id: int = 10  # keeps clear of the special tokens most vocabularies put first
    seed: int = 0
    output_scale: float | None = None  # max_tokens = ceil(output_length * this); None: block_tokens / 512

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if not 0 <= self.min_token_id < self.vocab_size:
            raise ValueError(
                f"min_token_id must be in [0, vocab_size={self.vocab_size}), got {self.min_token_id}"
            )
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and an output), got {self.max_model_len}"
            )
        if self.output_scale is not None and self.output_scale <= 0:
            raise ValueError(f"output_scale must be > 0, got {self.output_scale}")

    @property
    def scale(self) -> float:
        """Wire tokens per trace token of the prompt."""
        return self.block_tokens / TRACE_BLOCK_TOKENS

    @property
    def effective_output_scale(self) -> float:
        return self.scale if self.output_scale is None else self.output_scale


@dataclass(frozen=True)
class WireRequest:
    """What the replay sends for one trace request, and when."""

    trace: TraceRequest
    send_at_s: float  # seconds after the replay starts
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    chain: tuple[int, ...]  # chain[i]: interned id of trace blocks 0..i (see PrefixChains)
    prompt_tokens_cut: int  # scaled prompt tokens dropped to fit max_model_len
    output_tokens_cut: int  # scaled output tokens dropped (only when the output alone does not fit)


class BlockTokens:
    """The token ids of trace blocks: ``block_tokens`` ids in [low, vocab) per hash id, memoised."""

    def __init__(self, synthesis: Synthesis) -> None:
        self.synthesis = synthesis
        self._cache: dict[int, np.ndarray] = {}

    def of(self, hash_id: int) -> np.ndarray:
        """(block_tokens,) int64: the same ids for the same (seed, hash_id), whatever came before."""
        block = self._cache.get(hash_id)
        if block is None:
            s = self.synthesis
            rng = np.random.default_rng([s.seed, hash_id])
            block = rng.integers(s.min_token_id, s.vocab_size, size=s.block_tokens, dtype=np.int64)
            self._cache[hash_id] = block
        return block


class PrefixChains:
    """Interns prefixes of hash ids: equal leading ids give equal chain ids, whatever the format promises.

    The Mooncake format already makes an id stand for its whole prefix; interning ``(parent, id)``
    keeps a hand-made trace that reuses an id after a different prefix from counting as shared.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def chain(self, hash_ids: Iterable[int]) -> tuple[int, ...]:
        out: list[int] = []
        parent = -1
        for h in hash_ids:
            parent = self._ids.setdefault((parent, h), len(self._ids))
            out.append(parent)
        return tuple(out)


def scaled_lengths(req: TraceRequest, synthesis: Synthesis) -> tuple[int, int]:
    """(prompt tokens, max_tokens) after scaling, before the max_model_len cap."""
    prompt = math.ceil(req.input_length * synthesis.scale)  # keeps len(hash_ids) blocks: see docstring
    output = max(1, math.ceil(req.output_length * synthesis.effective_output_scale))
    return prompt, output


def plan(trace: Sequence[TraceRequest], synthesis: Synthesis, time_scale: float = 1.0,
         duration_s: float | None = None) -> list[WireRequest]:  # fmt: skip
    """Wire requests for ``trace`` in send order, sent at (timestamp - earliest) / time_scale seconds.

    Requests whose send time falls past ``duration_s`` are left out (open loop: nothing waits for
    an earlier request, so the schedule is fixed before the first one is sent).
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if not trace:
        return []
    t0 = min(req.timestamp_ms for req in trace)
    blocks, chains = BlockTokens(synthesis), PrefixChains()
    bt, max_len = synthesis.block_tokens, synthesis.max_model_len
    out: list[WireRequest] = []
    for req in trace:
        send_at = (req.timestamp_ms - t0) / 1000.0 / time_scale
        if duration_s is not None and send_at > duration_s:
            continue
        prompt_len, output = scaled_lengths(req, synthesis)
        output_cut = max(0, output - (max_len - 1))
        output -= output_cut
        kept = min(prompt_len, max_len - output)
        n_blocks = math.ceil(kept / bt)
        ids = np.concatenate([blocks.of(h) for h in req.hash_ids[:n_blocks]])[:kept]
        out.append(
            WireRequest(
                trace=req,
                send_at_s=send_at,
                prompt=tuple(ids.tolist()),
                max_tokens=output,
                chain=chains.chain(req.hash_ids[:n_blocks]),
                prompt_tokens_cut=prompt_len - kept,
                output_tokens_cut=output_cut,
            )
        )
    out.sort(key=lambda w: w.send_at_s)  # stable: trace order among equal timestamps
    return out


def ideal_cached_tokens(requests: Sequence[WireRequest], block_tokens: int, kv_block_size: int) -> list[int]:
    """Per request, the prompt tokens an unlimited prefix cache would serve, in send order.

    Counted like the engine's block manager: only whole ``kv_block_size`` blocks, at most
    ``(prompt_len - 1) // kv_block_size`` of them (the last prompt token is always computed), the
    longest leading run whose blocks some earlier request of the slice computed; every request then
    adds its own full blocks. KV block ``j`` covers tokens ``[j*kb, (j+1)*kb)``; its tokens are
    fixed by the chain id of the trace block holding token ``(j+1)*kb - 1`` and where in that trace
    block it ends, so that pair is its key.
    """
    if kv_block_size < 1:
        raise ValueError(f"kv_block_size must be >= 1, got {kv_block_size}")
    seen: set[tuple[int, int]] = set()
    out: list[int] = []
    for req in requests:
        n = len(req.prompt)
        keys = []
        for j in range(n // kv_block_size):
            end = (j + 1) * kv_block_size  # exclusive end of KV block j, in prompt tokens
            b = (end - 1) // block_tokens  # trace block holding its last token
            keys.append((req.chain[b], end - b * block_tokens))
        hits = 0
        for key in keys[: (n - 1) // kv_block_size]:
            if key not in seen:
                break
            hits += 1
        out.append(hits * kv_block_size)
        seen.update(keys)
    return out
