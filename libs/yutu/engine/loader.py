"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into LlamaForCausalLM.

The model is built on the meta device (no random init, no memory), materialised empty on the target
device, then every tensor is read from safetensors, cast and copied in. Tensor names are Hugging
Face's own (``model.layers.3.self_attn.q_proj.weight``, ...), which are also our ``state_dict`` keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from yutu.engine.model import LlamaForCausalLM
from yutu.engine.model_config import IMAGE_TEXT_DEFAULTS, ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint's weight files are missing, incomplete or do not match config.json."""


def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not readable)."""
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # x86 flags of bfloat16 arithmetic in hardware


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with ``flags``) does bfloat16 arithmetic in hardware."""
    return (
        bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))
        and torch.backends.mkldnn.is_available()
    )


def auto_dtype(device: torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """What ``--dtype auto`` picks: bfloat16 on CUDA; on a CPU bfloat16 where it has native
    bfloat16 arithmetic (AVX512-BF16 dot products or AMX tiles), float32 otherwise.

    Measured (2026-12-01, a 2-core AMD EPYC with AVX512-BF16 and no AMX, the demo model, one torch
    thread, the two dtypes interleaved in one process; ``loadtests/bench_engine.py``): with the
    linear weights prepacked for oneDNN (:func:`yutu.engine.model.pack_cpu_linears`) and the
    decode attention in one SDPA call, bfloat16 runs a 512-token prefill 1.6x, a batch-1 decode
    step at a 512-token context 1.1-1.2x and a batch-16 one 1.3x as fast as float32. Before the
    packing, PyTorch's bfloat16 GEMM cost ~15-20 us per call on this CPU and a batch-1 decode was
    slower in bfloat16 (0.84-1.0x), so this rule picked float32 on AVX512-BF16 then.
    The rule reads only the device and its flags, so every instance on a host picks alike (KV
    blocks of different dtypes must never be shared: the dtype is part of the KV salt).
    """
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and native_bf16(flags):
        return torch.bfloat16
    return torch.float32


def resolve_device(choice: str) -> str:
    """The device of ``--device``: auto is cuda where torch sees a GPU, else cpu; cuda where it sees
    none is refused (ValueError)."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here")
    return choice


def default_device_and_dtype() -> tuple[torch.device, torch.dtype]:
    """CUDA when a GPU is available, else CPU; the dtype of :func:`auto_dtype`."""
    device = torch.device(resolve_device("auto"))
    return device, auto_dtype(device)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for ``config`` holds, by Hugging Face name, in a fixed order.

    ``lm_head.weight`` is absent when the embeddings are tied.
    """
    h, i = config.hidden_size, config.intermediate_size
    qd, kvd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        if config.input_norms:
            shapes[p + "input_layernorm.weight"] = (h,)
        if config.model_type == "phi3":  # q, k and v as one tensor (parameter_parts)
            shapes[p + "self_attn.qkv_proj.weight"] = (qd + 2 * kvd, h)
        else:
            for name, out_dim in (("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)):
                shapes[p + f"self_attn.{name}.weight"] = (out_dim, h)
                if config.attention_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (out_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, qd)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:  # per head, or across all heads (OLMo 2)
            shapes[p + "self_attn.q_norm.weight"] = (qd,) if config.qk_norm_whole else (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kvd,) if config.qk_norm_whole else (config.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.sandwich_norms:
            if config.input_norms:
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if n in config.moe_layers:
            shapes.update(_expert_shapes(config, p))
        elif config.model_type == "phi3":  # gate and up as one tensor (parameter_parts)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        else:
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                shapes[p + f"mlp.{name}.weight"] = shape
                if config.mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


# Mixtral's checkpoints name a layer's experts their own way; the model's modules are Qwen3-MoE's.
_MIXTRAL_NAMES = {
    ".block_sparse_moe.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


def _expert_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and experts, as its checkpoint names them."""
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    if config.model_type == "mixtral":
        moe, names = "block_sparse_moe", (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i)))
    else:
        moe, names = "mlp", (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}{moe}.gate.weight": (e, h)}
    for expert in range(e):
        for name, shape in names:
            shapes[f"{prefix}{moe}.experts.{expert}.{name}.weight"] = shape
    s = config.shared_expert_size  # Qwen2-MoE's shared expert and its gate
    if s:
        for name, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
            shapes[f"{prefix}mlp.shared_expert.{name}.weight"] = shape
        shapes[f"{prefix}mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def parameter_name(config: ModelConfig, name: str) -> str:
    """The model's parameter that checkpoint tensor ``name`` fills."""
    if config.model_type == "mixtral" and ".block_sparse_moe." in name:
        for theirs, ours in _MIXTRAL_NAMES.items():
            name = name.replace(theirs, ours)
    return name


# An image-text checkpoint's language model tensors, as its text model names them: the layout of
# Google's uploads (and of transformers' saving) first, then transformers 4.52-4.57's
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_IMAGE_TOWERS = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def text_tensor_name(config: ModelConfig, name: str) -> str | None:
    """Checkpoint tensor ``name`` as the text model names it, or None for the parts of an image-text
    checkpoint that are not loaded (its vision tower and projector: the gateway refuses images)."""
    if config.architecture not in IMAGE_TEXT_DEFAULTS:
        return name
    for theirs, ours in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return None if name.startswith(_IMAGE_TOWERS) else name


def parameter_parts(config: ModelConfig, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters that checkpoint tensor ``name`` fills, each with its rows of it: one,
    whole, except where a checkpoint stores projections fused (Phi-3's ``qkv_proj`` holds q, k and v
    one after another, ``gate_up_proj`` gate then up)."""
    if config.model_type != "phi3":
        return [(parameter_name(config, name), tensor)]
    kvd = config.num_kv_heads * config.head_dim
    fused = {
        "self_attn.qkv_proj": {"q_proj": config.num_heads * config.head_dim, "k_proj": kvd, "v_proj": kvd},
        "mlp.gate_up_proj": {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size},
    }
    for module, parts in fused.items():
        if name.endswith(f".{module}.weight"):
            prefix = name.removesuffix(f"{module.rsplit('.', 1)[1]}.weight")
            rows = tensor.split(list(parts.values()))
            return [(f"{prefix}{part}.weight", r) for part, r in zip(parts, rows, strict=True)]
    return [(name, tensor)]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: the sharded index's files, model.safetensors, or *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" (found {', '.join(other)}: convert them to safetensors first)" if other else ""
    raise CheckpointError(f"no *.safetensors weights in {model_dir}{hint}")


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype, max_model_len: int | None = None
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for ``model_dir`` on ``device`` in ``dtype``, in eval mode, without gradients,
    for contexts up to ``max_model_len`` (None: the default; see ``ModelConfig.for_context``).

    Raises FileNotFoundError if config.json is missing, UnsupportedModelError (a ValueError) for an
    architecture we cannot run, CheckpointError (a ValueError) for missing, extra or misshapen tensors.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir).for_context(max_model_len)
    files = safetensors_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty allocates the two names separately: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())  # tied lm_head.weight is listed once, as the embedding
    expected = expected_weight_shapes(config)
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for stored in f.keys():  # noqa: SIM118 -- safe_open is not a dict
                    name = text_tensor_name(config, stored)
                    if name is None:
                        continue  # an image-text checkpoint's vision part
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # old checkpoints store RoPE tables; we compute them
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # some tied checkpoints store a copy of the embedding
                    if name not in expected:
                        raise CheckpointError(
                            f"unexpected tensor {stored!r} in {file.name}: the checkpoint does not match "
                            f"{config.architecture} as described by config.json"
                        )
                    tensor = f.get_tensor(stored)
                    if tuple(tensor.shape) != expected[name]:
                        raise CheckpointError(
                            f"tensor {stored!r} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {expected[name]}"
                        )
                    for target, rows in parameter_parts(config, name, tensor):
                        params[target].copy_(rows.to(dtype=dtype))
                    loaded.add(name)
    missing = [name for name in expected if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {model_dir} lacks tensor(s): {shown}")
    model.eval().requires_grad_(False)
    return model, config
