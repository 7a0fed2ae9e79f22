"""The built-in demo model: a small random-weight Llama with a real tokenizer, made offline.

``ensure_default_model()`` returns its directory, creating it on first use: the tokenizer is trained
from a generated corpus and the weights drawn from a seeded generator, so every machine writes the
same bytes. Its weights are random, so its text is meaningless: ``config.json`` carries
``"yutu_demo": true`` so services can say so. It exists so the whole stack runs with no download.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from yutu.engine.demo_tokenizer import BOS, EOS, EOT, SPECIAL_TOKENS, TokenizerFiles, train_demo_tokenizer
from yutu.engine.loader import INDEX_FILE, SINGLE_FILE, expected_weight_shapes
from yutu.engine.model_config import ModelConfig
from yutu.engine.model_source import DEFAULT_MODEL_NAME

DEFAULT_MODEL_VERSION = "v1"  # bump when the recipe below changes: the cache dir name changes with it
_SEED = 20250225
_VOCAB_TARGET = 2560

_README = f"""# {DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_VERSION})

Built-in demo model of Yutu: a Llama-architecture decoder (hidden 256, 4 layers, 8 query heads,
2 key/value heads) with RANDOM weights and a byte-level BPE tokenizer trained on a small generated
corpus. Its output text is meaningless. It exists so Yutu runs end to end offline; serve a real
Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral checkpoint directory for real
answers.
Generated deterministically by yutu.engine.default_model (seed {_SEED}).
"""


def cache_root() -> Path:
    """What Yutu builds and keeps on a machine lives under: $YUTU_CACHE_DIR, else ~/.cache/yutu."""
    return Path(os.environ.get("YUTU_CACHE_DIR") or Path.home() / ".cache" / "yutu")


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the demo model lives: <root>/models/<name>-<version>.

    root is ``cache_dir`` if given, else :func:`cache_root`.
    """
    root = cache_dir or cache_root()
    return Path(root) / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The demo model's directory, written on first use (see default_model_dir).

    Safe against concurrent first use: each process writes into its own temporary directory next
    to the target and renames it into place; the loser of the race discards its copy.
    """
    target = default_model_dir(cache_dir)
    if target.exists():
        if not (target / "config.json").is_file():
            raise RuntimeError(f"{target} exists but holds no demo model: delete it and retry")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_default_model(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process renamed first
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def demo_hf_config(vocab_size: int) -> dict[str, Any]:
    """config.json of the demo model."""
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOT], ids[EOS]],
        "torch_dtype": "bfloat16",
        "yutu_demo": True,
    }


def _write_default_model(out_dir: Path) -> None:
    tokenizer = train_demo_tokenizer(_VOCAB_TARGET, seed=0)
    vocab_size = Tokenizer.from_str(tokenizer.tokenizer_json).get_vocab_size(with_added_tokens=True)
    write_checkpoint(out_dir, demo_hf_config(vocab_size), _SEED, tokenizer, dtype=torch.bfloat16)
    (out_dir / "README.md").write_text(_README, encoding="utf-8")


def write_checkpoint(
    out_dir: Path,
    hf_config: dict[str, Any],
    seed: int,
    tokenizer_dir_or_obj: Path | TokenizerFiles,
    *,
    init_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 1,
) -> Path:
    """Write a Hugging Face checkpoint with seeded random weights into ``out_dir`` (created if needed).

    Files: config.json, generation_config.json, model.safetensors (or ``num_shards`` shards plus
    model.safetensors.index.json), and the tokenizer -- copied from a directory, or written from a
    TokenizerFiles. Weights are N(0, init_std) (norm weights 1 + N(0, init_std)), drawn in the fixed
    order of expected_weight_shapes, so the same arguments always give the same bytes.
    """
    config = ModelConfig.from_hf_dict(hf_config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(config).items():
        t = torch.randn(shape, generator=gen) * init_std
        if name.endswith("norm.weight"):
            t += 1.0
        tensors[name] = t.to(dtype).contiguous()
    _save_weights(out_dir, tensors, num_shards)

    (out_dir / "config.json").write_text(
        json.dumps(hf_config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    gen_config: dict[str, Any] = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
    }
    (out_dir / "generation_config.json").write_text(
        json.dumps(gen_config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    write_tokenizer(out_dir, tokenizer_dir_or_obj)
    return out_dir


def write_tokenizer(out_dir: Path, tokenizer_dir_or_obj: Path | TokenizerFiles) -> None:
    """The tokenizer files of a checkpoint: written from a TokenizerFiles, or copied from a directory."""
    if isinstance(tokenizer_dir_or_obj, TokenizerFiles):
        (out_dir / "tokenizer.json").write_text(tokenizer_dir_or_obj.tokenizer_json, encoding="utf-8")
        (out_dir / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_dir_or_obj.tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False)
            + "\n",
            encoding="utf-8",
        )
    else:
        src = Path(tokenizer_dir_or_obj)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            if (src / name).is_file():
                shutil.copyfile(src / name, out_dir / name)


def _save_weights(out_dir: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards == 1:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = list(tensors)
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    for s in range(num_shards):
        shard_name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[s * per_shard : (s + 1) * per_shard]}
        save_file(chunk, str(out_dir / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, shard_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
