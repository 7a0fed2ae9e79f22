"""Helpers of the engine tests: a tiny engine on CPU, deterministic prompts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from yutu.engine.engine import EngineConfig, LLMEngine

VOCAB = 512  # the tiny checkpoint's vocabulary


def make_engine(ckpt: Path, **overrides: Any) -> LLMEngine:
    """64 KV blocks of 16 tokens, a 256-token context, CPU float32 (``overrides`` change any of it)."""
    kwargs: dict[str, Any] = {"model_dir": ckpt, "device": "cpu", "dtype": "float32", "num_kv_blocks": 64,
                              "max_model_len": 256}  # fmt: skip
    return LLMEngine(EngineConfig(**{**kwargs, **overrides}))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]
