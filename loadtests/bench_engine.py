"""Engine benchmark on the built-in demo model (or --model): a script, not a timed test.

Measures, in one run on one engine:
  * prefill tokens/s at batch 1 and 16 (prompt tokens / wall time until each request's first token)
  * decode tokens/s at batch 1 and 16 (generated tokens / wall time of the decode-only steps)
  * TTFT of a 1024-token prompt cold, and with its first 896 tokens already in the prefix cache
    (medians of three, after a round that warms both up)
  * on CPU, bfloat16 against float32 (prefill, decode at batch 1 and 16), interleaved: the
    measurement behind ``--dtype auto``
  * decode tokens/s at batch 16 with 1024-token contexts, the dense decode cache on (the default
    on CPU) against off (every decode gathers its blocks: the reference path), both attending with
    torch's SDPA, and the dense cache with the native kernels (yutu.engine.native), interleaved
  * decode tokens/s at batch 1 and 16, and a 1024-token prompt's TTFT, with the native kernels
    (the engines' path on CPU: decode attention, each layer's norms, rotary and SwiGLU) against
    torch's operations (the reference), interleaved
  * decode tokens/s at batch 1 and 16 with fused projections (q/k/v, gate/up; the engines' path)
    against the separate ones (the reference), interleaved
  * on CPU, the sampler on the native kernel (``greedy_rows``: greedy tokens and the logprobs'
    normalisers) against torch's operations (the reference): decode tokens/s at batch 1 and 16 with
    and without logprobs, interleaved (the sampler alone, at larger vocabularies: bench_sampler.py)
  * with ``--compile``, on CPU: ``torch.compile`` (inductor, dynamic shapes) of each layer's MLP and
    norms on torch's operations, against the same eager and against the native kernels: decode
    tokens/s at batch 1 and 16, interleaved, and the seconds the first steps took to compile. In
    float32: the bfloat16 path's prepacked oneDNN products do not trace with dynamic shapes
and prints a table plus ratios against the same-run baselines (batch 1, cold, dense off). Writes JSON.

    .venv/bin/python loadtests/bench_engine.py [--model DIR] [--out bench_engine.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch
from yutu.config import DTYPES
from yutu.engine.engine import EngineConfig, LLMEngine
from yutu.engine.loader import load_model
from yutu.engine.model import Linear, pack_cpu_linears
from yutu.engine.model_source import resolve_model
from yutu.engine.sampler import Sampler
from yutu.engine.sampling import SamplingParams


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def run_to_first_token(engine: LLMEngine, reqs: dict[str, list[int]], params: SamplingParams) -> float:
    """Add ``reqs`` together and step until each has its first token; returns the wall time."""
    start = time.perf_counter()
    for rid, ids in reqs.items():
        engine.add_request(rid, ids, params)
    waiting = set(reqs)
    while waiting:
        for out in engine.step():
            if out.new_token_ids:
                waiting.discard(out.request_id)
    return time.perf_counter() - start


def finish(engine: LLMEngine) -> tuple[int, float]:
    """Step until idle; returns (tokens generated, wall time) of these decode steps."""
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens, time.perf_counter() - start


TTFT_ROUNDS = 3  # measured rounds of the TTFT rows (their median), after one that warms up


def bench(model_dir: Path, threads: int, dtype: str = "auto") -> dict[str, float]:
    torch.set_num_threads(threads)
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir, kv_cache_memory_bytes=512 * 2**20, max_num_batched_tokens=2048, dtype=dtype
        )
    )
    vocab = engine.model_config.vocab_size
    decode = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    results: dict[str, float] = {}

    run_to_first_token(engine, {"warmup": prompts(1, 64, vocab, 99)[0]}, decode)
    finish(engine)

    for batch, length in ((1, 512), (16, 128)):
        reqs = {f"p{batch}-{i}": p for i, p in enumerate(prompts(batch, length, vocab, seed=batch))}
        elapsed = run_to_first_token(engine, reqs, decode)
        results[f"prefill_tok_s_b{batch}"] = batch * length / elapsed
        tokens, elapsed = finish(engine)
        results[f"decode_tok_s_b{batch}"] = (tokens - batch) / elapsed if tokens > batch else 0.0

    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # Round 0 warms both paths up: on CUDA a shape's first use costs 10-40x (H200, bfloat16: a cached
    # prefix's TTFT 190 ms the first time, 4.3-4.5 ms after), and bench_engine reports steady state.
    cold, cached = [], []
    for r in range(TTFT_ROUNDS + 1):
        cold_prompt, donor = prompts(2, 1024, vocab, seed=7 + r)
        cold.append(run_to_first_token(engine, {f"cold{r}": cold_prompt}, one_token))
        finish(engine)
        prefix = donor[:896]
        run_to_first_token(engine, {f"donor{r}": prefix + prompts(1, 16, vocab, seed=1000 + r)[0]}, one_token)
        finish(engine)
        cached.append(run_to_first_token(engine, {f"warm{r}": prefix + cold_prompt[896:]}, one_token))
        finish(engine)
    results["ttft_cold_1024_s"] = statistics.median(cold[1:])
    results["ttft_cached_896_of_1024_s"] = statistics.median(cached[1:])
    results["decode_b16_over_b1"] = results["decode_tok_s_b16"] / results["decode_tok_s_b1"]
    results["ttft_cold_over_cached"] = results["ttft_cold_1024_s"] / results["ttft_cached_896_of_1024_s"]
    engine.block_manager.check_integrity()
    return results


def dense_ab(model_dir: Path, threads: int, rounds: int = 3) -> dict[str, float]:
    """Decode tokens/s of 16 sequences with 1024-token prompts, dense decode cache off and on
    (``rounds`` interleaved runs each, the best of each kept: the machine is shared)."""
    torch.set_num_threads(threads)
    engines = {
        name: LLMEngine(
            EngineConfig(
                model_dir=model_dir,
                kv_cache_memory_bytes=512 * 2**20,
                max_num_batched_tokens=2048,
                dense_decode_bytes=budget,
                kernels=kernel,
            )
        )  # fmt: skip
        for name, budget, kernel in (
            ("paged", 0, "torch"),
            ("dense", None, "torch"),
            ("native", None, "auto"),
        )
    }
    params = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    best = {name: 0.0 for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            vocab = engine.model_config.vocab_size
            reqs = {f"{name}{r}-{i}": p for i, p in enumerate(prompts(16, 1024, vocab, seed=100 + r))}
            run_to_first_token(engine, reqs, params)
            tokens, elapsed = finish(engine)
            best[name] = max(best[name], tokens / elapsed)
    for engine in engines.values():
        engine.block_manager.check_integrity()
    return {"decode_tok_s_b16_ctx1024_paged": best["paged"], "decode_tok_s_b16_ctx1024_dense": best["dense"],
            "decode_tok_s_b16_ctx1024_dense_native": best["native"],
            "dense_over_paged": best["dense"] / best["paged"],
            "dense_native_over_paged": best["native"] / best["paged"]}  # fmt: skip


def decode_ab(
    engines: dict[str, LLMEngine], rounds: int, seed: int, logprobs: int | None = None
) -> dict[str, float]:
    """Decode tokens/s of each engine at batch 1 (a 1024-token context) and batch 16 (512),
    ``rounds`` interleaved runs, the medians: ``{name}_decode_tok_s_b1`` and ``_b16``."""
    runs: dict[str, list[float]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True, logprobs=logprobs)
    for r in range(rounds):
        for name, engine in engines.items():
            vocab = engine.model_config.vocab_size
            run_to_first_token(engine, {f"{name}{r}": prompts(1, 1024, vocab, seed=seed + r)[0]}, params)
            tokens, elapsed = finish(engine)
            runs.setdefault(f"{name}_decode_tok_s_b1", []).append(tokens / elapsed)
            reqs = {f"{name}{r}-{i}": p for i, p in enumerate(prompts(16, 512, vocab, seed=seed + 100 + r))}
            run_to_first_token(engine, reqs, params)
            tokens, elapsed = finish(engine)
            runs.setdefault(f"{name}_decode_tok_s_b16", []).append(tokens / elapsed)
    return {key: statistics.median(values) for key, values in runs.items()}


def kernel_ab(model_dir: Path, threads: int, rounds: int = 5) -> dict[str, float]:
    """The native kernels (``kernels`` auto: what engines on CPU run: decode attention, each
    layer's norms, rotary and SwiGLU) against torch's operations (the reference), interleaved:
    decode (``decode_ab``) and the TTFT of a 1024-token prompt (medians)."""
    torch.set_num_threads(threads)
    engines = {f"{k}_kernel": LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=256 * 2**20,
                                                     kernels=k))
               for k in ("auto", "torch")}  # fmt: skip
    best = decode_ab(engines, rounds, seed=600)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            vocab = engine.model_config.vocab_size
            ttft[name].append(
                run_to_first_token(engine, {f"{name}{r}p": prompts(1, 1024, vocab, seed=700 + r)[0]}, one)
            )
            finish(engine)
    best["kernels"] = 1.0 if engines["auto_kernel"].kernels == "native" else 0.0
    for what in ("decode_tok_s_b1", "decode_tok_s_b16"):
        best[f"native_over_torch_{what}"] = best[f"auto_kernel_{what}"] / best[f"torch_kernel_{what}"]
    best["native_over_torch_prefill1024_speed"] = statistics.median(ttft["torch_kernel"]) / statistics.median(
        ttft["auto_kernel"]
    )
    return best


def fused_ab(model_dir: Path, threads: int, rounds: int = 5) -> dict[str, float]:
    """Fused projections (q/k/v and gate/up, ``fuse_projections``, what engines run) against the
    separate ones (the reference), interleaved (``decode_ab``)."""
    torch.set_num_threads(threads)
    engines = {}
    for name in ("fused", "separate"):
        engine = LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=256 * 2**20))
        if name == "separate":  # load the reference model again, unfused (and packed, as the engine does)
            model, _ = load_model(model_dir, engine.device, engine.dtype)
            if any(isinstance(m, Linear) and m.packed is not None for m in engine.runner.model.modules()):
                pack_cpu_linears(model)
            engine.runner.model = model
        engines[name] = engine
    best = decode_ab(engines, rounds, seed=400)
    for what in ("decode_tok_s_b1", "decode_tok_s_b16"):
        best[f"fused_over_separate_{what}"] = best[f"fused_{what}"] / best[f"separate_{what}"]
    return best


def sampler_ab(model_dir: Path, threads: int, rounds: int = 5) -> dict[str, float]:
    """The sampler on the native kernel (what engines on CPU run) against torch's operations (the
    reference), interleaved (``decode_ab``, without logprobs and with the sampled token's)."""
    torch.set_num_threads(threads)
    engines = {name: LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=256 * 2**20))
               for name in ("kernel_sampler", "torch_sampler")}  # fmt: skip
    engines["torch_sampler"].sampler = Sampler()
    best = decode_ab(engines, rounds, seed=800)
    with_logprobs = decode_ab(engines, rounds, seed=900, logprobs=0)
    best |= {f"{key}_logprobs": value for key, value in with_logprobs.items()}
    for what in (
        "decode_tok_s_b1",
        "decode_tok_s_b16",
        "decode_tok_s_b1_logprobs",
        "decode_tok_s_b16_logprobs",
    ):
        best[f"kernel_over_torch_sampler_{what}"] = (
            best[f"kernel_sampler_{what}"] / best[f"torch_sampler_{what}"]
        )
    return best


def dtype_ab(model_dir: Path, threads: int, rounds: int = 3) -> dict[str, float]:
    """float32 against bfloat16 (what ``--dtype auto`` chooses between on a CPU): prefill of a
    512-token prompt, decode at batch 1 and 16, ``rounds`` interleaved runs, the best of each."""
    torch.set_num_threads(threads)
    engines = {d: LLMEngine(EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=256 * 2**20, dtype=d))
               for d in ("float32", "bfloat16")}  # fmt: skip
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
    best: dict[str, float] = {}
    for r in range(rounds):
        for d, engine in engines.items():
            vocab = engine.model_config.vocab_size
            t = run_to_first_token(engine, {f"{d}{r}p": prompts(1, 512, vocab, seed=200 + r)[0]}, one)
            finish(engine)
            best[f"{d}_prefill512_s"] = min(best.get(f"{d}_prefill512_s", math.inf), t)
            for batch in (1, 16):
                reqs = {
                    f"{d}{r}b{batch}-{i}": p for i, p in enumerate(prompts(batch, 128, vocab, seed=300 + r))
                }
                run_to_first_token(engine, reqs, decode)
                tokens, elapsed = finish(engine)
                key = f"{d}_decode_tok_s_b{batch}"
                best[key] = max(best.get(key, 0.0), tokens / elapsed)
    for what in ("decode_tok_s_b1", "decode_tok_s_b16"):
        best[f"bf16_over_f32_{what}"] = best[f"bfloat16_{what}"] / best[f"float32_{what}"]
    best["bf16_over_f32_prefill_speed"] = best["float32_prefill512_s"] / best["bfloat16_prefill512_s"]
    return best


def compile_ab(model_dir: Path, threads: int, rounds: int = 4) -> dict[str, float]:
    """``torch.compile`` of each decoder layer's MLP and norms (the parts that trace: the attention
    reads per-step Python metadata, on which a compiled layer recompiles step after step) against
    the same engine eager and against the native kernels, float32 (module docstring)."""
    torch.set_num_threads(threads)

    def make(kernels: str) -> LLMEngine:
        config = EngineConfig(
            model_dir=model_dir, kv_cache_memory_bytes=256 * 2**20, kernels=kernels, dtype="float32"
        )
        return LLMEngine(config)

    engines = {"native": make("auto"), "eager": make("torch"), "compiled": make("torch")}
    for layer in engines["compiled"].runner.model.model.layers:
        for module in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            module.forward = torch.compile(module.forward, dynamic=True)  # type: ignore[method-assign]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    compile_s = 0.0
    for name, engine in engines.items():
        vocab = engine.model_config.vocab_size
        start = time.perf_counter()
        run_to_first_token(engine, {f"{name}-w1": prompts(1, 1024, vocab, seed=1)[0]}, warm)
        run_to_first_token(
            engine, {f"{name}-w16-{i}": p for i, p in enumerate(prompts(16, 512, vocab, seed=2))}, warm
        )
        finish(engine)
        if name == "compiled":
            compile_s = time.perf_counter() - start
    best = decode_ab(engines, rounds, seed=900)
    best["compiled_first_steps_s"] = compile_s
    for what in ("decode_tok_s_b1", "decode_tok_s_b16"):
        best[f"compiled_over_eager_{what}"] = best[f"compiled_{what}"] / best[f"eager_{what}"]
        best[f"compiled_over_native_{what}"] = best[f"compiled_{what}"] / best[f"native_{what}"]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in demo model)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--out", default="bench_engine.json", help="where to write the JSON results")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="engine dtype (auto: as the engines pick it)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile of the decode path (CPU; adds a minute or two)",
    )
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = bench(model_dir, args.threads, args.dtype) | dense_ab(model_dir, args.threads)
    results |= fused_ab(model_dir, args.threads) | kernel_ab(model_dir, args.threads)
    if device == "cpu":
        results |= dtype_ab(model_dir, args.threads) | sampler_ab(model_dir, args.threads)
        if args.compile:
            results |= compile_ab(model_dir, args.threads)
    print(f"engine benchmark: {model_dir.name}, {args.threads} threads, device {device}, dtype {args.dtype}")
    rows = [
        ("prefill tokens/s, batch 1 (512-token prompt)", results["prefill_tok_s_b1"], "tok/s"),
        ("prefill tokens/s, batch 16 (128-token prompts)", results["prefill_tok_s_b16"], "tok/s"),
        ("decode tokens/s, batch 1", results["decode_tok_s_b1"], "tok/s"),
        ("decode tokens/s, batch 16", results["decode_tok_s_b16"], "tok/s"),
        ("  ratio decode batch 16 / batch 1", results["decode_b16_over_b1"], "x"),
        ("TTFT 1024-token prompt, cold", results["ttft_cold_1024_s"] * 1000, "ms"),
        ("TTFT 1024-token prompt, 896 tokens cached", results["ttft_cached_896_of_1024_s"] * 1000, "ms"),
        ("  ratio cold / cached", results["ttft_cold_over_cached"], "x"),
        (
            "decode tokens/s, batch 16, 1024 context, paged",
            results["decode_tok_s_b16_ctx1024_paged"],
            "tok/s",
        ),
        (
            "decode tokens/s, batch 16, 1024 context, dense",
            results["decode_tok_s_b16_ctx1024_dense"],
            "tok/s",
        ),
        ("  ratio dense / paged", results["dense_over_paged"], "x"),
        (
            "  same, dense with the native kernels",
            results["decode_tok_s_b16_ctx1024_dense_native"],
            "tok/s",
        ),
        ("  ratio dense native / paged", results["dense_native_over_paged"], "x"),
    ]
    rows += [
        ("fused / separate projections: decode batch 1", results["fused_over_separate_decode_tok_s_b1"], "x"),
        (
            "fused / separate projections: decode batch 16",
            results["fused_over_separate_decode_tok_s_b16"],
            "x",
        ),
    ]
    if results["kernels"]:
        rows += [
            ("native / torch kernels: decode batch 1", results["native_over_torch_decode_tok_s_b1"], "x"),
            ("native / torch kernels: decode batch 16", results["native_over_torch_decode_tok_s_b16"], "x"),
            (
                "native / torch kernels: prefill 1024 tokens",
                results["native_over_torch_prefill1024_speed"],
                "x",
            ),
        ]
    else:
        print("(the native kernels could not be built here: see the warning above)")
    if "bf16_over_f32_prefill_speed" in results:
        rows += [
            ("bfloat16 / float32 speed: prefill 512 tokens", results["bf16_over_f32_prefill_speed"], "x"),
            ("bfloat16 / float32 speed: decode batch 1", results["bf16_over_f32_decode_tok_s_b1"], "x"),
            ("bfloat16 / float32 speed: decode batch 16", results["bf16_over_f32_decode_tok_s_b16"], "x"),
        ]
    if results["kernels"] and "kernel_sampler_decode_tok_s_b1" in results:
        labels = {"b1": "decode batch 1", "b16": "decode batch 16", "b1_logprobs": "decode batch 1, logprobs",
                  "b16_logprobs": "decode batch 16, logprobs"}  # fmt: skip
        ratio = "kernel_over_torch_sampler_decode_tok_s_"
        rows += [
            (f"kernel / torch sampler: {label}", results[ratio + what], "x") for what, label in labels.items()
        ]
    if "compiled_first_steps_s" in results:
        rows += [
            ("torch.compile / eager: decode batch 1", results["compiled_over_eager_decode_tok_s_b1"], "x"),
            ("torch.compile / eager: decode batch 16", results["compiled_over_eager_decode_tok_s_b16"], "x"),
            ("torch.compile / native: decode batch 1", results["compiled_over_native_decode_tok_s_b1"], "x"),
            (
                "torch.compile / native: decode batch 16",
                results["compiled_over_native_decode_tok_s_b16"],
                "x",
            ),
            ("torch.compile: its first steps (compiling)", results["compiled_first_steps_s"], "s"),
        ]
    for label, value, unit in rows:
        print(f"{label:<48} {value:>10.2f} {unit}")
    Path(args.out).write_text(
        json.dumps(
            {"model": model_dir.name, "threads": args.threads, "dtype": args.dtype, **results}, indent=2
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
