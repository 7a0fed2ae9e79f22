"""The built-in demo model: deterministic bytes, atomic creation, loads and runs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from yutu.engine.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_VERSION,
    default_model_dir,
    ensure_default_model,
)
from yutu.engine.loader import load_model
from yutu.engine.testing import PagedRunner, greedy_generate
from yutu.engine.tokenizer import IncrementalDetokenizer, Tokenizer

EXPECTED_FILES = [
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
_ENSURE = "import sys; from pathlib import Path; from yutu.engine.default_model import ensure_default_model as e; print(e(Path(sys.argv[1])))"


def _digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("demo"))


def test_layout_and_marker(demo_dir: Path, tmp_path: Path) -> None:
    assert demo_dir.name == f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"
    assert demo_dir.parent.name == "models"
    assert sorted(p.name for p in demo_dir.iterdir()) == EXPECTED_FILES
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["yutu_demo"] is True
    assert "meaningless" in (demo_dir / "README.md").read_text()
    assert default_model_dir(tmp_path) == tmp_path / "models" / demo_dir.name


def test_byte_identical_across_processes(demo_dir: Path, tmp_path: Path) -> None:
    """A second build, in another process (other hash seeds, other allocator), writes the same bytes."""
    out = subprocess.run(
        [sys.executable, "-c", _ENSURE, str(tmp_path)], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert Path(out) == default_model_dir(tmp_path)
    assert _digests(Path(out)) == _digests(demo_dir)


def test_concurrent_first_use_is_atomic(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _ENSURE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    target = default_model_dir(tmp_path)
    assert outs == [str(target)] * 3
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temp dirs left
    assert sorted(p.name for p in target.iterdir()) == EXPECTED_FILES


def test_second_call_reuses_directory(demo_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()}
    assert ensure_default_model(demo_dir.parent.parent) == demo_dir
    assert {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()} == before


def test_env_cache_dir_and_broken_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YUTU_CACHE_DIR", str(tmp_path))
    target = default_model_dir()
    assert target == tmp_path / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"
    target.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="delete it and retry"):
        ensure_default_model()


def test_loads_and_runs(demo_dir: Path) -> None:
    torch.set_num_threads(1)
    model, config = load_model(demo_dir, torch.device("cpu"), torch.float32)
    tok = Tokenizer.from_dir(demo_dir)
    assert config.yutu_demo and config.tie_word_embeddings
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (256, 4, 8, 2)
    assert config.vocab_size == tok.vocab_size == 2560
    assert config.max_position_embeddings == 4096
    assert tok.eos_token_ids == config.eos_token_ids == (4, 1)

    prompt = tok.encode_chat([{"role": "user", "content": "Tell me about the moon 🌕"}])
    (logits,) = PagedRunner(model, 8, 16).step([(0, prompt)])
    assert logits.shape == (len(prompt), 2560) and torch.isfinite(logits).all()
    out = greedy_generate(model, prompt, 8)
    assert len(out) == 8 and all(0 <= t < 2560 for t in out)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.push([t]) for t in out) + detok.flush() == tok.decode(out)
