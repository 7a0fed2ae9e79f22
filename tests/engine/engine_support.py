"""Helpers of the engine tests: a tiny engine on CPU, deterministic prompts.

``YUTU_TEST_DEVICE=cuda`` runs the engines these helpers make on a GPU instead (every test that
builds its engine with :func:`make_engine` and no device of its own): the engine suites' references
(transformers on CPU in float32, the engine running each request alone) then check the CUDA path.
``loadtests/gpu_check.sh`` does that on a machine with a GPU.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from yutu.engine.engine import EngineConfig, LLMEngine

VOCAB = 512  # the tiny checkpoint's vocabulary
TEST_DEVICE = os.environ.get("YUTU_TEST_DEVICE", "cpu")


def make_engine(ckpt: Path, **overrides: Any) -> LLMEngine:
    """64 KV blocks of 16 tokens, a 256-token context, float32 on ``YUTU_TEST_DEVICE`` (default the
    CPU); ``overrides`` change any of it."""
    kwargs: dict[str, Any] = {"model_dir": ckpt, "device": TEST_DEVICE, "dtype": "float32", "num_kv_blocks": 64,
                              "max_model_len": 256}  # fmt: skip
    return LLMEngine(EngineConfig(**{**kwargs, **overrides}))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]
