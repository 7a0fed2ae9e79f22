"""Fixtures of the engine tests: one torch thread, a tiny random Llama checkpoint per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from yutu.engine.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", arch="llama", seed=0)
