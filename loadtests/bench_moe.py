"""A mixture of experts against a dense model of the same active width: a script, not a timed test.

Builds two tiny random checkpoints in a temporary directory (the same attention; a Mixtral of
``--experts`` SwiGLU experts of width ``--expert-width``, ``--per-token`` of them a token, and a
Llama whose one MLP is as wide as those ``--per-token`` experts together), and measures on one
engine each, in rounds that alternate between them:

  * decode tokens/s at batch 1 and 16 (generated tokens / wall time of the decode-only steps), the
    mixture against the dense model: what routing and the per-expert gather and scatter cost
    beside the products they save;
  * decode tokens/s on the mixture with its fast paths (``SparseMoE.forward``: at batch 1 the one
    token's experts straight, at batch 16 the tokens grouped by expert) against the general path
    (``SparseMoE.reference``: each expert finds its tokens), the measurements behind them.

Prints medians and ratios against the same run's baselines, and writes JSON.

    .venv/bin/python loadtests/bench_moe.py [--rounds 3] [--tokens 64] [--out bench_moe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from yutu.engine.engine import EngineConfig, LLMEngine
from yutu.engine.model import SparseMoE
from yutu.engine.sampling import SamplingParams
from yutu.engine.testing import make_tiny_checkpoint

PROMPT = 32  # tokens of each request's prompt


def decode_rate(engine: LLMEngine, batch: int, tokens: int) -> float:
    """Generated tokens per second of the decode-only steps of ``batch`` requests."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", [5 + (i + j) % 200 for j in range(PROMPT)], params)
    engine.step()  # the prompts (and each one's first token)
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are printed")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--experts", type=int, default=8, help="experts of the mixture")
    parser.add_argument("--per-token", type=int, default=2, help="experts a token goes through")
    parser.add_argument("--expert-width", type=int, default=512, help="an expert's intermediate size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default="bench_moe.json", help="where to write the JSON results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 32, "max_position_embeddings": 1024}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="yutu-bench-moe-") as tmp:
        dense_dir = make_tiny_checkpoint(
            Path(tmp) / "dense", "llama", intermediate_size=args.per_token * args.expert_width, **shape
        )
        moe_dir = make_tiny_checkpoint(Path(tmp) / "moe", "mixtral", intermediate_size=args.expert_width,
                                       num_local_experts=args.experts, num_experts_per_tok=args.per_token,
                                       **shape)  # fmt: skip

        def engine(model_dir: Path) -> LLMEngine:
            config = EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=64 * 2**20, dtype="float32")
            return LLMEngine(config)

        dense, moe, moe_reference = engine(dense_dir), engine(moe_dir), engine(moe_dir)
        for module in moe_reference.runner.model.modules():
            if isinstance(module, SparseMoE):
                module.forward = module.reference  # type: ignore[method-assign]
        runs: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, eng, batch in (("dense_b1", dense, 1), ("moe_b1", moe, 1), ("moe_reference_b1", moe_reference, 1),
                                     ("dense_b16", dense, 16), ("moe_b16", moe, 16),
                                     ("moe_reference_b16", moe_reference, 16)):  # fmt: skip
                runs.setdefault(name, []).append(decode_rate(eng, batch, args.tokens))
    res = {name: statistics.median(rates) for name, rates in runs.items()}
    res |= {
        "moe_over_dense_b1": res["moe_b1"] / res["dense_b1"],
        "moe_over_dense_b16": res["moe_b16"] / res["dense_b16"],
        "one_token_path_over_reference_b1": res["moe_b1"] / res["moe_reference_b1"],
        "grouped_path_over_reference_b16": res["moe_b16"] / res["moe_reference_b16"],
    }
    print(f"decode tokens/s (medians of {args.rounds}; {args.experts} experts of {args.expert_width}, "
          f"{args.per_token} a token, against a dense MLP of {args.per_token * args.expert_width})")  # fmt: skip
    print(
        f"  batch 1:  dense {res['dense_b1']:8.0f}  mixture {res['moe_b1']:8.0f}  ({res['moe_over_dense_b1']:.2f}x)"
    )
    print(
        f"  batch 16: dense {res['dense_b16']:8.0f}  mixture {res['moe_b16']:8.0f}  ({res['moe_over_dense_b16']:.2f}x)"
    )
    print(f"  batch 1, the mixture's one-token path against its general path: "
          f"{res['moe_b1']:.0f} / {res['moe_reference_b1']:.0f} = {res['one_token_path_over_reference_b1']:.2f}x")  # fmt: skip
    print(f"  batch 16, the mixture's tokens grouped by expert against its general path: "
          f"{res['moe_b16']:.0f} / {res['moe_reference_b16']:.0f} = {res['grouped_path_over_reference_b16']:.2f}x")  # fmt: skip
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
