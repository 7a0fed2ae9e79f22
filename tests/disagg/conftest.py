"""Fixtures of the disaggregation tests: a tiny model with a 2048-token context."""

from __future__ import annotations

from pathlib import Path

import pytest
from yutu.engine.testing import make_tiny_checkpoint

from tests.disagg.disagg_support import MAX_MODEL_LEN


@pytest.fixture(scope="session")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("dg-model") / "tiny",
        arch="llama",
        seed=0,
        max_position_embeddings=MAX_MODEL_LEN,
    )
