"""The default served model name, one rule for the worker, the gateway and `yutu up`."""

from __future__ import annotations

import json
from pathlib import Path

from yutu.engine.model_source import DEFAULT_MODEL_NAME, served_model_name


def _checkpoint(path: Path, **config: object) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **config}))
    return path


def test_served_names(tmp_path: Path) -> None:
    demo = _checkpoint(tmp_path / "yutu-demo-tiny-v1", yutu_demo=True)
    assert served_model_name(None, demo) == DEFAULT_MODEL_NAME == "yutu-demo-tiny"
    local = _checkpoint(tmp_path / "Llama-3.2-1B")
    assert served_model_name(str(local), local) == "Llama-3.2-1B"
    snapshot = _checkpoint(tmp_path / "hub" / "snapshots" / "0123abcd")
    assert served_model_name("meta-llama/Llama-3.2-1B", snapshot) == "meta-llama/Llama-3.2-1B"
