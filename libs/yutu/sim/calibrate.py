"""``yutu calibrate``: measure our engine on this machine and write a simulator profile.

It runs the real engine (:class:`yutu.engine.LLMEngine`; the built-in demo model unless ``--model``)
through a small grid, each point a few times (the median kept):

- prefill: prompts of ``L`` tokens whose first ``p`` tokens are in the engine's prefix cache (a
  first request with the same head put them there), for a few ``L`` and ``p``; the step's time
  computing ``[p, L)`` is one sample of ``(L, p, seconds)``;
- decode: ``b`` sequences of ``c`` context tokens decoding together; a step's time is one sample of
  ``(b, kv_tokens, seconds)``;
- transfer: copies of a block-sized buffer (host memory bandwidth: what moving KV between processes
  on one machine costs).

The samples are fitted by the conductor's own cost models (:mod:`yutu.sched.costs`, the robust
non-negative fit), so the profile has exactly the forms the policies predict with. Capacities come
from the engine (its KV pool; its prefix cache is that pool) in blocks of ``--block-size`` tokens (512,
the Mooncake traces' hash-id granularity, by default). Well under a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from yutu.config import option
from yutu.sched import DecodeCostModel, PrefillCostModel
from yutu.sim.profile import TRACE_BLOCK_SIZE, Profile

PREFILL_POINTS = ((64, 0), (128, 0), (256, 0), (384, 0), (256, 128), (384, 256), (384, 128), (512, 256))
DECODE_POINTS = ((1, 64), (4, 64), (8, 64), (16, 64), (4, 256), (8, 256), (16, 192))
ENGINE_BLOCK = 16  # the engine's own paging block (prefix hits are counted in these)


@dataclass(frozen=True)
class Samples:
    prefills: list[tuple[int, int, float]]  # (prompt_len, reused_tokens, seconds)
    steps: list[tuple[int, int, float]]  # (batch, kv_tokens, seconds)
    copy_bps: float  # bytes/s of a host copy
    kv_bytes_per_token: int
    kv_pool_tokens: int
    max_batch: int


def fit_profile(samples: Samples, name: str, block_size: int = TRACE_BLOCK_SIZE, source: str = "") -> Profile:
    """A profile from measurements, fitted with the conductor's cost models (module docstring)."""
    if len(samples.prefills) < 3 or len(samples.steps) < 3:
        raise ValueError("need at least 3 prefill and 3 decode samples to fit the profile")
    prefill = PrefillCostModel(min_samples=3, window=max(3, len(samples.prefills)))
    for length, reused, seconds in samples.prefills:
        prefill.observe(length, reused, seconds)
    decode = DecodeCostModel(min_samples=3, window=max(3, len(samples.steps)))
    for batch, kv, seconds in samples.steps:
        decode.observe(batch, kv, seconds)
    blocks = max(1, samples.kv_pool_tokens // block_size)
    a, b, c = prefill.coefficients
    return Profile(
        name=name,
        block_size=block_size,
        kv_bytes_per_token=samples.kv_bytes_per_token,
        prefill=(a, b, c),
        decode=(decode.coefficients[0], decode.coefficients[1], decode.coefficients[2]),
        network_bps=samples.copy_bps,
        transfer_latency_s=1e-4,
        prefill_kv_blocks=blocks,
        cache_blocks=blocks,
        decode_kv_blocks=blocks,
        max_batch=samples.max_batch,
        source=source,
    )


def measure(
    model_dir: Path,
    prefill_points: Sequence[tuple[int, int]] = PREFILL_POINTS,
    decode_points: Sequence[tuple[int, int]] = DECODE_POINTS,
    repeats: int = 3,
    kv_cache_mib: int = 512,
    max_batch: int = 64,
) -> Samples:
    """Run the engine over the grid (module docstring); the median of ``repeats`` per point."""
    import torch

    from yutu.engine.engine import EngineConfig, LLMEngine
    from yutu.engine.model_runner import kv_block_bytes

    # One step's budget fits the longest prompt and every decode batch's prompts: each prefill is one
    # step, and a batch's sequences start decoding together.
    budget = max(max(L for L, _ in prefill_points), max(b * (c + 1) for b, c in decode_points))
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            block_size=ENGINE_BLOCK,
            kv_cache_memory_bytes=kv_cache_mib * 2**20,
            max_num_seqs=max_batch,
            max_num_batched_tokens=budget,
            device="cpu",
        )
    )
    vocab = engine.model_config.vocab_size
    counter = iter(range(1, 1 << 30))

    def tokens(n: int, seed: int) -> list[int]:
        return [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]

    prefills: list[tuple[int, int, float]] = []
    for length, prefix in prefill_points:
        times = []
        for _ in range(repeats):
            head = tokens(prefix, next(counter)) if prefix else []
            if prefix:
                _run(engine, head + tokens(ENGINE_BLOCK, next(counter)), 1, counter)  # caches the head
            times.append(_prefill_seconds(engine, head + tokens(length - prefix, next(counter)), counter))
        prefills.append((length, prefix, statistics.median(times)))
    steps: list[tuple[int, int, float]] = []
    for batch, context in decode_points:
        times, kv = [], 0
        for _ in range(repeats):
            seconds, kv = _decode_step_seconds(
                engine, batch, [tokens(context, next(counter)) for _ in range(batch)], counter
            )
            times.append(seconds)
        steps.append((batch, kv, statistics.median(times)))
    block_bytes = kv_block_bytes(engine.model_config, ENGINE_BLOCK, engine.dtype)
    buf = torch.empty(block_bytes * 64 // 4, dtype=torch.float32)
    started = time.perf_counter()
    for _ in range(20):
        buf.clone()
    copy_bps = 20 * buf.numel() * 4 / (time.perf_counter() - started)
    return Samples(
        prefills, steps, copy_bps, block_bytes // ENGINE_BLOCK, engine.num_kv_blocks * ENGINE_BLOCK, max_batch
    )


def _params(max_tokens: int) -> Any:
    from yutu.engine.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: Any, prompt: list[int], max_tokens: int, counter: Any) -> None:
    engine.add_request(f"cal-{next(counter)}", prompt, _params(max_tokens))
    while engine.has_unfinished_requests():
        engine.step()


def _prefill_seconds(engine: Any, prompt: list[int], counter: Any) -> float:
    """Seconds of the step that computes the prompt's uncached tokens (one chunk: the budget fits it)."""
    engine.add_request(f"cal-{next(counter)}", prompt, _params(1))
    seconds = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step is not None and engine.last_step.num_prefill_tokens:
            seconds += engine.last_step.seconds
    return seconds


def _decode_step_seconds(
    engine: Any, batch: int, prompts: list[list[int]], counter: Any
) -> tuple[float, int]:
    """Median seconds of the pure decode steps of ``batch`` sequences, and their KV tokens then."""
    for prompt in prompts:
        engine.add_request(f"cal-{next(counter)}", prompt, _params(6))
    times, kv = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        last = engine.last_step
        if last is not None and last.num_prefill_tokens == 0 and last.num_decodes == batch:
            times.append(last.seconds)
            kv = last.decode_kv_tokens
    if not times:
        raise RuntimeError(f"no decode step ran all {batch} sequences together; raise --max-batch")
    return statistics.median(times), kv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = partial(option, parser, scope="calibrate")  # every option also from YUTU_CALIBRATE_<OPTION>
    a("--model", default=None, help="checkpoint dir (none: the built-in demo model)")
    a("--out", default="yutu-profile.json", help="profile file to write")
    a("--name", default=None, help="profile name (none: calibrated-<model>)")
    a("--block-size", type=int, default=TRACE_BLOCK_SIZE, help="tokens per simulated block")
    a("--repeats", type=int, default=3, help="runs per grid point (median kept)")
    a("--torch-threads", type=int, default=1, help="torch threads (1: a shared machine)")


def run(args: argparse.Namespace) -> int:
    import torch

    from yutu.engine.model_source import resolve_model

    torch.set_num_threads(max(1, args.torch_threads))
    model_dir = resolve_model(args.model)
    started = time.perf_counter()
    samples = measure(model_dir, repeats=max(1, args.repeats))
    name = args.name or f"calibrated-{model_dir.name}"
    source = (
        f"yutu calibrate: {model_dir.name} on CPU ({args.torch_threads} torch threads), "
        f"{len(samples.prefills)} prefill and {len(samples.steps)} decode points x {args.repeats}"
    )
    try:
        profile = fit_profile(samples, name, args.block_size, source)
    except ValueError as exc:
        print(f"yutu calibrate: {exc}", file=sys.stderr)
        return 1
    Path(args.out).write_text(profile.to_json())
    print(
        f"wrote {args.out} in {time.perf_counter() - started:.1f} s: prefill {profile.prefill}, decode {profile.decode}"
    )
    return 0
