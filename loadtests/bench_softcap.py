"""Gemma 2's soft-capped attention on the native kernels: a script, not a timed test.

Times, on random inputs of a Gemma-2-shaped layer (8 query heads, 4 KV heads, head dim 64), in
float32 and bfloat16:

  * a 1,024-token prompt's causal attention (``prefill_attention``) and a decode step's attention
    over 512 cached keys at 1 and 8 sequences (``dense_decode_attention``);
  * each with the cap in the kernel (``softcap`` 50, Gemma 2's) against the same kernel uncapped
    (what the cap costs), and against the attention written out around torch's operations with
    ``torch.tanh`` (``yutu.engine.attention.sdpa``: the reference, and what capped models ran on
    before the kernels took the cap).

Prints medians and the ratios against the same run's baselines.

    .venv/bin/python loadtests/bench_softcap.py [--reps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from yutu.engine import native
from yutu.engine.attention import sdpa

CAP = 50.0  # Gemma 2's attn_logit_softcapping
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def median_ms(call: Callable[[], object], reps: int) -> float:
    call()  # warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20, help="timed calls per case (the median is printed)")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.load()
    scale = HEAD_DIM**-0.5
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<34} {'native':>9} {'capped':>9} {'torch capped':>13} {'cap costs':>10} {'vs torch':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        q = torch.randn(1024, HEADS, HEAD_DIM, generator=gen).to(dtype)
        k, v = (torch.randn(1024, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, n, hd), as paged_attention's
        rows = [
            (
                f"{name} prefill, 1,024 tokens",
                partial(kernels.prefill_attention, q, k, v, scale),
                partial(kernels.prefill_attention, q, k, v, scale, CAP),
                partial(sdpa, qt, kt, vt, scale=scale, is_causal=True, enable_gqa=True, softcap=CAP),
            )
        ]
        for slots in (1, 8):
            qd = torch.randn(slots, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            kd, vd = (torch.randn(slots, KV_HEADS, 512, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
            keys = (torch.zeros(slots, dtype=torch.long), torch.full((slots,), 512, dtype=torch.long))
            seen = torch.ones(slots, 1, 1, 512, dtype=torch.bool)
            rows.append(
                (
                    f"{name} decode, {slots} x 512 keys",
                    partial(kernels.dense_decode_attention, qd, kd, vd, *keys, scale),
                    partial(kernels.dense_decode_attention, qd, kd, vd, *keys, scale, CAP),
                    partial(sdpa, qd, kd, vd, attn_mask=seen, scale=scale, softcap=CAP),
                )
            )
        for label, plain, capped, reference in rows:
            reps = args.reps * (10 if "decode" in label else 1)
            a, b, c = (median_ms(call, reps) for call in (plain, capped, reference))
            print(f"{label:<34} {a:8.3f}ms {b:8.3f}ms {c:12.3f}ms {b / a:9.2f}x {c / b:8.1f}x")


if __name__ == "__main__":
    main()
