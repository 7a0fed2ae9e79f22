"""The dense decode cache (fast path) computes what paged attention (the reference) computes.

Each test runs the same requests through two engines that differ only in ``dense_decode_bytes``
(0: every decode gathers its blocks, the reference; otherwise decodes attend over the dense
cache, with the native kernel and with torch's SDPA) and checks the greedy tokens are equal and
the logprobs agree to 1e-5 -- with the buffers growing past their first capacity, a budget so small
that one step mixes both paths, preemption, shared prefixes, aborts, and a sliding-window model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import make_engine, prompt
from yutu.engine.decode_cache import MIN_CAPACITY, DenseDecodeCache
from yutu.engine.engine import LLMEngine
from yutu.engine.sampling import SamplingParams
from yutu.engine.testing import make_tiny_checkpoint

Result = dict[str, tuple[list[int], list[float]]]
KERNELS = pytest.mark.parametrize("kernel", ["native", "torch"])


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], int]], abort: dict[str, int] | None = None
) -> Result:
    """Every request added at once; greedy with logprobs; ``abort``: request -> abort after that many tokens."""
    out: Result = {}
    for rid, (ids, max_tokens) in requests.items():
        engine.add_request(
            rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        )
        out[rid] = ([], [])
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or ())
            if abort and len(out[o.request_id][0]) == abort.get(o.request_id) and not o.finished:
                engine.abort_request(o.request_id)
    engine.block_manager.check_integrity()
    return out


def assert_same(fast: Result, ref: Result) -> None:
    assert fast.keys() == ref.keys()
    for rid in ref:
        assert fast[rid][0] == ref[rid][0], rid
        assert fast[rid][1] == pytest.approx(ref[rid][1], abs=1e-5), rid


def both(ckpt: Path, requests: dict[str, tuple[list[int], int]], abort: dict[str, int] | None = None,
         **config: Any) -> tuple[Result, Result, LLMEngine]:  # fmt: skip
    fast_engine = make_engine(ckpt, **config)
    assert fast_engine.runner.dense is not None  # on by default on CPU
    assert fast_engine.kernels == config.get("kernels", fast_engine.kernels)
    fast = run(fast_engine, requests, abort)
    ref = run(make_engine(ckpt, **{**config, "dense_decode_bytes": 0, "kernels": "torch"}), requests, abort)
    return fast, ref, fast_engine


@KERNELS
def test_concurrent_decodes_of_mixed_lengths_grow_the_buffers_and_match_paged_attention(
    ckpt: Path, kernel: str
) -> None:
    requests = {f"r{i}": (prompt(n, seed=i), 40) for i, n in enumerate((5, 17, 64, 120, 250, 300, 9, 33))}
    fast, ref, engine = both(ckpt, requests, num_kv_blocks=256, max_model_len=512, dense_decode_bytes=4 << 20,
                             kernels=kernel)  # fmt: skip
    assert_same(fast, ref)
    dense = engine.runner.dense
    assert dense is not None and dense.capacity == 2 * MIN_CAPACITY and dense.slots >= 8  # grew past 256


@KERNELS
def test_a_budget_too_small_for_everyone_splits_a_step_between_both_paths(ckpt: Path, kernel: str) -> None:
    requests = {f"r{i}": (prompt(20 + 7 * i, seed=10 + i), 30) for i in range(6)}
    probe = make_engine(ckpt)
    assert probe.runner.dense is not None
    two_slots = 2 * MIN_CAPACITY * probe.runner.dense.token_bytes  # room for 2 of the 6 decodes
    fast, ref, engine = both(ckpt, requests, dense_decode_bytes=two_slots, kernels=kernel)
    assert_same(fast, ref)
    assert engine.runner.dense is not None and engine.runner.dense.slots == 2


@KERNELS
def test_preemption_shared_prefixes_and_aborts_match_paged_attention(ckpt: Path, kernel: str) -> None:
    shared = prompt(48, seed=99)
    requests = {f"s{i}": (shared + prompt(3 + i, seed=20 + i), 60) for i in range(4)}
    requests |= {f"u{i}": (prompt(30, seed=40 + i), 60) for i in range(3)}
    # 20 blocks of 16 tokens cannot hold 7 sequences growing to ~110 tokens: some are preempted.
    fast, ref, engine = both(ckpt, requests, abort={"s1": 7, "u2": 25}, num_kv_blocks=20, max_model_len=128,
                             kernels=kernel)  # fmt: skip
    assert_same(fast, ref)
    assert engine.stats().num_preemptions > 0


@KERNELS
def test_a_sliding_window_model_matches_paged_attention(tmp_path: Path, kernel: str) -> None:
    mistral = make_tiny_checkpoint(tmp_path / "tiny-mistral", arch="mistral", seed=3, sliding_window=24)
    requests = {f"r{i}": (prompt(n, seed=60 + i), 40) for i, n in enumerate((10, 30, 70))}
    fast, ref, _ = both(mistral, requests, kernels=kernel)
    assert_same(fast, ref)


def test_slots_follow_the_decodes_of_each_step() -> None:
    cache = DenseDecodeCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=1024, budget_bytes=1 << 20,
                             dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    first = cache.plan([(0, 0, "a", 3, [7]), (1, 1, "b", 1, [9])], block_size=4)
    assert first is not None and [(d.slot, d.context_len) for d in first.decodes] == [(0, 3), (1, 1)]
    # new to the cache: a's 3 positions and b's one are copied whole from their blocks, nothing one by one
    assert [(slot, ctx, blocks.tolist()) for slot, ctx, blocks in first.wholes] == [(0, 3, [7]), (1, 1, [9])]
    assert first.fill_slots.tolist() == []
    second = cache.plan(
        [(0, 0, "b", 2, [9]), (1, 1, "c", 1, [5])], block_size=4
    )  # a left: its slot is reused
    assert second is not None and [(d.slot, d.context_len) for d in second.decodes] == [(1, 2), (0, 1)]
    assert second.fill_slots.tolist() == [1] and second.fill_pos.tolist() == [1]  # b: only its new position
    assert second.fill_blocks.tolist() == [9] and second.fill_offsets.tolist() == [1]
    assert [(slot, ctx, blocks.tolist()) for slot, ctx, blocks in second.wholes] == [(0, 1, [5])]  # c is new
    assert cache.resident == 2 and cache.plan([], block_size=4) is None and cache.resident == 0
