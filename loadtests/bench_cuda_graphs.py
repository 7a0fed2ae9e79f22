"""What CUDA graphs would give a decode step of the demo model's shape (a GPU is needed for the graph).

On a GPU the engine's decode step is bound by the host: torch's profiler on an H200 counted 195
kernel launches a step at ~7 us of CPU each, and 0.6-0.8 ms of GPU kernel time in a step of 3-5.5
ms. A captured CUDA graph launches a whole step at once, but needs every shape and address fixed:
the engines' paged KV cache and growing contexts do not fit it as they are. This script measures
the prize before that redesign: a plain Llama decode step of the demo model's shape (hidden 256,
4 layers, 8 query heads over 2 KV heads of 32, SwiGLU 768, vocabulary 2,560; random weights) over
a static KV cache of ``--context`` positions (the new token's K/V written at its position,
attention masked past it), run eagerly and replayed as a captured graph, at batch 1 and 16; each
step ends with its tokens on the host, as an engine's does. Prints milliseconds per step, the ratio
eager / graph, and the largest difference between the graph's logits and the eager step's.
Without a GPU it times the eager step alone (a smoke run of the script).

    python loadtests/bench_cuda_graphs.py [--steps 200] [--context 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from yutu.engine.default_model import demo_hf_config
from yutu.engine.model_runner import CUDA_SDPA_BACKENDS

DEMO = demo_hf_config(vocab_size=2560)  # the demo model's shape (its vocabulary: 2,560 tokens)
HIDDEN, LAYERS, FFN, VOCAB = DEMO["hidden_size"], DEMO["num_hidden_layers"], DEMO["intermediate_size"], 2560
HEADS, KV_HEADS, HEAD_DIM = DEMO["num_attention_heads"], DEMO["num_key_value_heads"], DEMO["head_dim"]


@dataclass
class Layer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm1: torch.Tensor
    norm2: torch.Tensor


class Decoder:
    """A Llama decode step over a static KV cache: every tensor's shape and address fixed."""

    def __init__(self, batch: int, context: int, device: str, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * 0.05).to(device, dtype)

        ones = torch.ones(HIDDEN, device=device, dtype=dtype)
        self.layers = [
            Layer(weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), weight(HIDDEN, HEADS * HEAD_DIM),
                  weight(2 * FFN, HIDDEN), weight(HIDDEN, FFN), ones, ones)
            for _ in range(LAYERS)
        ]  # fmt: skip
        self.embed, self.head, self.norm = weight(VOCAB, HIDDEN), weight(VOCAB, HIDDEN), ones
        steps = torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM
        self.inv_freq = 1.0 / (DEMO["rope_theta"] ** steps)
        self.positions = torch.arange(context, device=device)
        shape = (batch, KV_HEADS, context, HEAD_DIM)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(LAYERS)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(LAYERS)]
        self.dtype = dtype

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + DEMO["rms_norm_eps"])
        return (xf * scale).to(self.dtype) * weight

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[:, None] * self.inv_freq[None]
        angles = torch.cat([freqs, freqs], -1)[:, None, None]
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return x * angles.cos().to(self.dtype) + torch.cat([-x2, x1], -1) * angles.sin().to(self.dtype)

    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits (batch, vocabulary) for ``tokens`` at positions ``pos`` (both (batch,))."""
        b = tokens.shape[0]
        x = self.embed[tokens][:, None]
        mask = (self.positions[None] <= pos[:, None])[:, None, None]
        where = pos[:, None, None, None].expand(b, KV_HEADS, 1, HEAD_DIM)
        for layer, k_cache, v_cache in zip(self.layers, self.k, self.v, strict=True):
            q, k, v = (self._rms(x, layer.norm1) @ layer.qkv.T).split(
                [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1
            )
            q = self._rope(q.view(b, 1, HEADS, HEAD_DIM).transpose(1, 2), pos)
            k_cache.scatter_(2, where, self._rope(k.view(b, 1, KV_HEADS, HEAD_DIM).transpose(1, 2), pos))
            v_cache.scatter_(2, where, v.view(b, 1, KV_HEADS, HEAD_DIM).transpose(1, 2))
            # a KV head's query heads as its query rows, as the engines' decode attention does
            qg = q.reshape(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
            attn = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask)
            x = x + attn.reshape(b, 1, HEADS * HEAD_DIM) @ layer.o.T
            gate, up = (self._rms(x, layer.norm2) @ layer.gate_up.T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer.down.T
        return (self._rms(x, self.norm) @ self.head.T)[:, 0].float()


def per_step_ms(run: Any, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps * 1e3


def measure(batch: int, context: int, steps: int, device: str) -> dict[str, float]:
    """Under the engines' attention backends (cuDNN left out on CUDA) and inference mode."""
    backends = sdpa_kernel(CUDA_SDPA_BACKENDS) if device == "cuda" else contextlib.nullcontext()
    with torch.inference_mode(), backends:
        return _measure(batch, context, steps, device)


def _measure(batch: int, context: int, steps: int, device: str) -> dict[str, float]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    decoder = Decoder(batch, context, device, dtype)
    tokens = torch.randint(10, VOCAB, (batch,), device=device)
    pos = torch.full((batch,), context // 2, device=device)
    for _ in range(3):
        decoder.step(tokens, pos)
    out = {"eager_ms": per_step_ms(lambda: decoder.step(tokens, pos).argmax(-1).tolist(), steps)}
    if device != "cuda":
        return out
    reference = decoder.step(tokens, pos)
    side = torch.cuda.Stream()  # warm up on a side stream before capture, as torch's docs do
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            decoder.step(tokens, pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = decoder.step(tokens, pos)
    graph.replay()
    out["max_abs_diff"] = (logits - reference).abs().max().item()

    def replay() -> None:
        graph.replay()
        logits.argmax(-1).tolist()

    out["graph_ms"] = per_step_ms(replay, steps)
    out["eager_over_graph"] = out["eager_ms"] / out["graph_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per figure")
    parser.add_argument("--context", type=int, default=1024, help="positions of the static KV cache")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.steps < 1 or args.context < 2:
        raise SystemExit("bench_cuda_graphs: error: --steps must be >= 1 and --context >= 2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {f"batch_{b}": measure(b, args.context, args.steps, device) for b in (1, 16)}
    print(f"a decode step of the demo model's shape, {args.context} static positions, device {device}:")
    for name, r in results.items():
        line = f"  {name.replace('_', ' ')}: eager {r['eager_ms']:.3f} ms"
        if "graph_ms" in r:
            line += (
                f", graph replay {r['graph_ms']:.3f} ms ({r['eager_over_graph']:.1f}x),"
                f" logits max |graph - eager| {r['max_abs_diff']:.2e}"
            )
        print(line)
    if device != "cuda":
        print("  (no GPU here: the graph is not measured)")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": device, "context": args.context, **results}, indent=2))


if __name__ == "__main__":
    main()
