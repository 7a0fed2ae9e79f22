"""Why engines on CUDA keep cuDNN out of scaled_dot_product_attention (a GPU is needed).

Times the attention calls of a run of decode steps -- a query row per sequence against a context
that grows by one token a step, with a mask, as ``yutu.engine.attention`` makes them -- and of
prompts of new lengths, with torch's default backend order and with the engines' order
(``yutu.engine.model_runner.CUDA_SDPA_BACKENDS``), in bfloat16 and float32. Prints milliseconds per
call and the ratio default / engines'.

    python loadtests/bench_cuda_sdpa.py
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from yutu.engine.model_runner import CUDA_SDPA_BACKENDS

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32  # the demo model's attention


def call(queries: int, keys: int, dtype: torch.dtype) -> None:
    q = torch.randn(1, HEADS, queries, HEAD_DIM, device="cuda", dtype=dtype)
    k = torch.randn(1, KV_HEADS, keys, HEAD_DIM, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(queries, keys, device="cuda", dtype=torch.bool).tril(keys - queries)
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def timed(shapes: list[tuple[int, int]], dtype: torch.dtype, engines_order: bool) -> float:
    """Median ms per call over ``shapes``, each shape new to this process's order."""
    times = []
    for queries, keys in shapes:
        order = sdpa_kernel(CUDA_SDPA_BACKENDS) if engines_order else contextlib.nullcontext()
        with order:
            torch.cuda.synchronize()
            start = time.perf_counter()
            call(queries, keys, dtype)
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    call(1, 16, torch.float32)  # the CUDA context, outside the timings
    for dtype in (torch.bfloat16, torch.float32):
        for name, base in (("decode (1 query, context +1 a step)", 1000), ("prompt (new length)", 300)):
            row = {}
            for engines_order in (True, False):  # the engines' first: the default's plans don't help it
                offset = 0 if engines_order else 200  # shapes neither order has seen
                if name.startswith("decode"):
                    shapes = [(1, base + offset + i) for i in range(40)]
                else:
                    shapes = [(base + offset + 7 * i, base + offset + 7 * i) for i in range(20)]
                row[engines_order] = timed(shapes, dtype, engines_order)
            print(
                f"{str(dtype):>15} {name:<38} default {row[False]:8.3f} ms  engines' {row[True]:8.3f} ms"
                f"  default / engines' {row[False] / row[True]:6.1f}x"
            )


if __name__ == "__main__":
    main()
