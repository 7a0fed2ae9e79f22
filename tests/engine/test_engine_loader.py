"""Checkpoint loading, config parsing and model-source resolution."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from yutu.engine.default_model import DEFAULT_MODEL_NAME, DEFAULT_MODEL_VERSION
from yutu.engine.loader import (
    CheckpointError,
    auto_dtype,
    default_device_and_dtype,
    expected_weight_shapes,
    load_model,
    parameter_name,
    parameter_parts,
    text_tensor_name,
)
from yutu.engine.model_config import ModelConfig, UnsupportedModelError
from yutu.engine.model_source import resolve_model
from yutu.engine.testing import PagedRunner, make_tiny_checkpoint, tiny_hf_config

CPU = torch.device("cpu")

# config.json of real checkpoints, trimmed to the keys that matter.
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
QWEN3_06B: dict[str, Any] = {  # Qwen/Qwen3-0.6B's config.json
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B: dict[str, Any] = {  # Qwen/Qwen3-30B-A3B's config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MIXTRAL_8X7B: dict[str, Any] = {  # mistralai/Mixtral-8x7B-v0.1's config.json
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def test_config_llama31() -> None:
    c = ModelConfig.from_hf_dict(LLAMA_31_8B)
    assert (c.architecture, c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM",
        "llama",
        32,
        32,
        8,
        128,
    )
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias or c.tie_word_embeddings)
    assert c.sliding_window is None and c.torch_dtype == "bfloat16"
    assert c.kv_cache_shape(10, 16) == (10, 32, 2, 16, 8, 128)
    assert c.kv_block_numel(16) == 32 * 2 * 16 * 8 * 128


def test_config_transformers5_rope_parameters_shape() -> None:
    """transformers 5 writes rope_theta and the scaling keys into one rope_parameters dict."""
    d = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    d["rope_parameters"] = {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0}
    d["dtype"] = "bfloat16"
    assert ModelConfig.from_hf_dict(d) == ModelConfig.from_hf_dict(LLAMA_31_8B)
    plain = {**d, "rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}}
    c = ModelConfig.from_hf_dict(plain)
    assert (c.rope_theta, c.rope_scaling) == (12345.0, None)


def test_config_qwen2_and_mistral() -> None:
    q = ModelConfig.from_hf_dict(QWEN25_05B)
    assert (q.attention_bias, q.o_proj_bias, q.tie_word_embeddings, q.head_dim) == (True, False, True, 64)
    assert q.sliding_window is None and q.eos_token_ids == (151643,)  # use_sliding_window is false
    q_sliding = ModelConfig.from_hf_dict({**QWEN25_05B, "use_sliding_window": True, "sliding_window": 4096})
    assert q_sliding.sliding_window_layers == (21, 22, 23)
    assert q_sliding.layer_sliding_window(21) == 4096 and q_sliding.layer_sliding_window(20) is None
    m = ModelConfig.from_hf_dict(MISTRAL_7B_V01)
    assert m.sliding_window == 4096 and m.sliding_window_layers == tuple(range(32))
    assert not m.attention_bias and m.model_type == "mistral"
    no_window = ModelConfig.from_hf_dict({**MISTRAL_7B_V01, "sliding_window": None})
    assert no_window.sliding_window is None and no_window.layer_sliding_window(0) is None


def test_config_mixtures_of_experts() -> None:
    """Qwen3-30B-A3B: 128 experts of 768, 8 per token, renormalized, every layer sparse; Mixtral
    8x7B: 8 of 14336, 2 per token, every layer; the checkpoint's tensors as each names them."""
    q = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    assert (q.model_type, q.qk_norm, q.head_dim, q.attention_bias) == ("qwen3_moe", True, 128, False)
    assert (q.num_experts, q.experts_per_token, q.moe_intermediate_size, q.norm_topk_prob) == (
        128,
        8,
        768,
        True,
    )
    assert q.moe_layers == tuple(range(48)) and q.sliding_window is None
    mixed = ModelConfig.from_hf_dict({**QWEN3_30B_A3B, "mlp_only_layers": [0, 5], "decoder_sparse_step": 2})
    assert mixed.moe_layers == tuple(i for i in range(48) if i % 2 == 1 and i != 5)
    shapes = expected_weight_shapes(q)
    assert shapes["model.layers.3.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.3.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert "model.layers.3.mlp.gate_proj.weight" not in shapes
    m = ModelConfig.from_hf_dict(MIXTRAL_8X7B)
    assert (m.model_type, m.qk_norm, m.attention_bias, m.sliding_window) == ("mixtral", False, False, None)
    assert (m.num_experts, m.experts_per_token, m.moe_intermediate_size, m.norm_topk_prob) == (
        8,
        2,
        14336,
        True,
    )
    assert m.moe_layers == tuple(range(32))
    shapes = expected_weight_shapes(m)
    assert shapes["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)
    assert parameter_name(m, "model.layers.0.block_sparse_moe.experts.7.w3.weight") == (
        "model.layers.0.mlp.experts.7.up_proj.weight"
    )
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9"):
        ModelConfig.from_hf_dict({**MIXTRAL_8X7B, "num_experts_per_tok": 9})


PHI_4: dict[str, Any] = {  # microsoft/phi-4's config.json
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 100257,
    "embd_pdrop": 0.0,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 17920,
    "max_position_embeddings": 16384,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 10,
    "original_max_position_embeddings": 16384,
    "pad_token_id": 100257,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 250000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 100352,
}


def test_config_phi3() -> None:
    """Phi-4 (Phi3ForCausalLM): Llama's shape, no biases, q/k/v and gate/up each one tensor in the
    checkpoint, split into the model's projections; a sliding window on every layer where set
    (2047 in a Phi-3 config); LongRoPE (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) and partial rotation refused."""
    c = ModelConfig.from_hf_dict(PHI_4)
    assert (c.model_type, c.num_kv_heads, c.head_dim, c.rope_theta, c.rope_scaling) == (
        "phi3",
        10,
        128,
        250000.0,
        None,
    )
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias or c.qk_norm) and c.sliding_window is None
    shapes = expected_weight_shapes(c)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (5120 + 2 * 1280, 5120)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 17920, 5120)
    assert (
        "model.layers.0.self_attn.q_proj.weight" not in shapes
        and "model.layers.0.mlp.up_proj.weight" not in shapes
    )
    small = ModelConfig.from_hf_dict({**PHI_4, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
                                      "head_dim": 4, "intermediate_size": 3})  # fmt: skip
    qkv = torch.arange(16 * 8).reshape(16, 8)
    parts = parameter_parts(small, "model.layers.3.self_attn.qkv_proj.weight", qkv)
    assert [name for name, _ in parts] == [
        f"model.layers.3.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")
    ]
    assert [t.tolist() for _, t in parts] == [qkv[:8].tolist(), qkv[8:12].tolist(), qkv[12:].tolist()]
    gate_up = torch.arange(6 * 8).reshape(6, 8)
    (gate, g), (up, u) = parameter_parts(small, "model.layers.3.mlp.gate_up_proj.weight", gate_up)
    assert (gate, up) == ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight")
    assert (g.tolist(), u.tolist()) == (gate_up[:3].tolist(), gate_up[3:].tolist())
    assert parameter_parts(small, "model.norm.weight", qkv) == [("model.norm.weight", qkv)]
    mini = ModelConfig.from_hf_dict({**PHI_4, "sliding_window": 2047, "num_hidden_layers": 32})
    assert mini.sliding_window == 2047 and mini.sliding_window_layers == tuple(range(32))
    assert ModelConfig.from_hf_dict({**PHI_4, "partial_rotary_factor": 0.75}).rope_dim == 96  # of 128
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=1.5"):
        ModelConfig.from_hf_dict({**PHI_4, "partial_rotary_factor": 1.5})
    with pytest.raises(UnsupportedModelError, match="rotate 1 of each head's 128 dims"):
        ModelConfig.from_hf_dict({**PHI_4, "partial_rotary_factor": 0.01})


# Shaped like microsoft/Phi-3.5-mini-instruct's config.json (its factors are 48 measured values)
PHI_35_MINI: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_scaling": {"long_factor": [1.0 + i for i in range(48)], "short_factor": [1.0 + i / 100 for i in range(48)],
                     "type": "longrope"},
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "vocab_size": 32064,
    "bos_token_id": 1,
    "eos_token_id": 32000,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-05,
}  # fmt: skip


# Shaped like microsoft/Phi-4-mini-instruct's config.json (its factors are 48 measured values)
PHI_4_MINI: dict[str, Any] = {
    **PHI_35_MINI,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75,
    "vocab_size": 200064,
    "tie_word_embeddings": True,
    "eos_token_id": 199999,
    "bos_token_id": 199999,
}


def test_config_partial_rotation() -> None:
    """Phi-4-mini: RoPE on the first 96 of each head's 128 dims, its LongRoPE lists one factor per
    rotated pair (48); partial rotation only where transformers does it (Phi-3's layout)."""
    c = ModelConfig.from_hf_dict(PHI_4_MINI)
    assert (c.head_dim, c.rope_dim, c.positions_served, c.num_kv_heads) == (128, 96, 4096, 8)
    v5 = {k: v for k, v in PHI_4_MINI.items() if k != "partial_rotary_factor"}
    v5["rope_parameters"] = {"partial_rotary_factor": 0.75, "rope_theta": 10000.0}
    assert ModelConfig.from_hf_dict(v5).rope_dim == 96
    long64 = {**PHI_4_MINI["rope_scaling"], "long_factor": [1.0] * 64}
    with pytest.raises(UnsupportedModelError, match="long_factor has 64 entries; 96 rotated dims"):
        ModelConfig.from_hf_dict({**PHI_4_MINI, "rope_scaling": long64})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5 is not supported here"):
        ModelConfig.from_hf_dict({**tiny_hf_config("llama"), "partial_rotary_factor": 0.5})


def test_config_longrope() -> None:
    """LongRoPE (Phi-3.5, Phi-3 128k): both factor lists kept, the attention factor transformers
    derives from 131072 / 4096 positions (or the config's own), served up to 4096 positions; lists
    of the wrong length or no pretraining length refused."""
    c = ModelConfig.from_hf_dict(PHI_35_MINI)
    scaling = c.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["short_factor"] == PHI_35_MINI["rope_scaling"]["short_factor"]
    assert scaling["original_max_position_embeddings"] == 4096
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert (c.positions_served, c.max_position_embeddings, c.head_dim) == (4096, 131072, 96)
    own = {**PHI_35_MINI, "rope_scaling": {**PHI_35_MINI["rope_scaling"], "attention_factor": 1.5}}
    assert ModelConfig.from_hf_dict(own).rope_scaling["attention_factor"] == 1.5  # type: ignore[index]
    v5 = {
        k: v
        for k, v in PHI_35_MINI.items()
        if k not in ("rope_scaling", "rope_theta", "original_max_position_embeddings")
    }
    v5["rope_parameters"] = {
        **PHI_35_MINI["rope_scaling"],
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 4096,
    }
    assert ModelConfig.from_hf_dict(v5).rope_scaling == scaling
    assert ModelConfig.from_hf_dict(PHI_4).positions_served == PHI_4["max_position_embeddings"]
    short = {**PHI_35_MINI, "rope_scaling": {**PHI_35_MINI["rope_scaling"], "short_factor": [1.0] * 47}}
    with pytest.raises(
        UnsupportedModelError, match=r"short_factor has 47 entries; 96 rotated dims \(head_dim=96\) need 48"
    ):
        ModelConfig.from_hf_dict(short)
    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings"):
        ModelConfig.from_hf_dict(
            {k: v for k, v in PHI_35_MINI.items() if k != "original_max_position_embeddings"}
        )
    with pytest.raises(UnsupportedModelError, match="long_factor"):
        ModelConfig.from_hf_dict(
            {**PHI_35_MINI, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}}
        )


def test_config_yarn() -> None:
    """YaRN as Qwen's model cards tell users to add it to Qwen3: read with transformers' defaults
    (betas 32 and 1, truncated, attention factor 0.1 ln 4 + 1), the context its factor reaches
    (4 x 32,768) served; its attention factor from mscale / mscale_all_dim, or as given; a factor
    left out is the ratio of the lengths."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    c = ModelConfig.from_hf_dict({**QWEN3_06B, "rope_scaling": yarn})
    assert c.rope_scaling == {**yarn, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                              "attention_factor": 0.1 * math.log(4.0) + 1}  # fmt: skip
    assert c.max_position_embeddings == 131072 and QWEN3_06B["max_position_embeddings"] == 40960
    m = ModelConfig.from_hf_dict(
        {**QWEN3_06B, "rope_scaling": {**yarn, "mscale": 1.0, "mscale_all_dim": 0.5}}
    )
    assert m.rope_scaling is not None
    assert m.rope_scaling["attention_factor"] == pytest.approx(
        (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    )
    given = ModelConfig.from_hf_dict({**QWEN3_06B, "rope_scaling": {**yarn, "attention_factor": 1.5}})
    assert given.rope_scaling is not None and given.rope_scaling["attention_factor"] == 1.5
    implied = ModelConfig.from_hf_dict(
        {**QWEN3_06B, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 10240}}
    )
    assert implied.rope_scaling is not None and implied.rope_scaling["factor"] == 4.0


OLMO_2_1B: dict[str, Any] = {  # OLMo 2 1B's shape, as its config.json sets it
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "attention_bias": False,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "pad_token_id": 100277,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 500000,
    "tie_word_embeddings": True,
    "vocab_size": 100352,
}


def test_config_olmo2_and_olmo3() -> None:
    """OLMo 2: the blocks' outputs normalized (post_attention_layernorm, post_feedforward_layernorm),
    their inputs not; q/k norms of all heads' width; no window. OLMo 3: three sliding layers in four
    (window 4096 by default), the sliding ones rotating by the base unscaled while a YaRN scales the
    full ones (transformers 4.x's rope_scaling, or 5.x's rope_parameters per layer type)."""
    c = ModelConfig.from_hf_dict(OLMO_2_1B)
    assert (c.sandwich_norms, c.input_norms, c.qk_norm, c.qk_norm_whole, c.norm_weight_float32) == (
        True, False, True, True, True,
    )  # fmt: skip
    assert c.sliding_window is None and c.rope_theta == 500000.0 and c.eos_token_ids == (100257,)
    shapes = expected_weight_shapes(c)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (2048,)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (2048,)
    assert "model.layers.0.input_layernorm.weight" not in shapes
    assert "model.layers.0.pre_feedforward_layernorm.weight" not in shapes
    assert shapes["model.layers.0.post_feedforward_layernorm.weight"] == (2048,)
    gqa = ModelConfig.from_hf_dict({**OLMO_2_1B, "num_key_value_heads": 4})
    assert expected_weight_shapes(gqa)["model.layers.0.self_attn.k_norm.weight"] == (512,)
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    olmo3 = {**OLMO_2_1B, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "rope_scaling": yarn,
             "max_position_embeddings": 65536, "sliding_window": 4096}  # fmt: skip
    c3 = ModelConfig.from_hf_dict(olmo3)
    assert (c3.sliding_window, c3.sliding_window_layers) == (4096, tuple(i for i in range(16) if (i + 1) % 4))
    assert c3.rope_scaling is not None and c3.rope_scaling["rope_type"] == "yarn"
    assert (c3.rope_theta, c3.sliding_rope_theta) == (500000.0, 500000.0)
    v5 = {k: v for k, v in olmo3.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {"full_attention": {**yarn, "rope_theta": 500000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    c5 = ModelConfig.from_hf_dict(v5)
    assert c5.rope_scaling == c3.rope_scaling and (c5.rope_theta, c5.sliding_rope_theta) == (
        500000.0,
        10000.0,
    )
    with pytest.raises(UnsupportedModelError, match="sliding layers' rope_type='linear'"):
        ModelConfig.from_hf_dict({**v5, "rope_parameters": {**v5["rope_parameters"],
                                  "sliding_attention": {"rope_type": "linear", "factor": 2.0}}})  # fmt: skip


MISTRAL_SMALL_31: dict[str, Any] = {  # Mistral Small 3.1's shape, as its config.json sets it
    "architectures": ["Mistral3ForConditionalGeneration"],
    "image_token_index": 10,
    "model_type": "mistral3",
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": {
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "vocab_size": 131072,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "num_hidden_layers": 24},
    "vision_feature_layer": -1,
}


def test_config_mistral3_image_text() -> None:
    """Mistral Small 3.1 / 3.2: the language model of its text_config (Mistral's, no window), token
    ids and tying by MistralConfig's defaults where neither level says; its tensors renamed from
    either layout, the vision tower and projector left out."""
    c = ModelConfig.from_hf_dict(MISTRAL_SMALL_31)
    assert (c.architecture, c.model_type, c.hidden_size, c.head_dim, c.num_layers) == (
        "Mistral3ForConditionalGeneration", "mistral", 5120, 128, 40,
    )  # fmt: skip
    assert (c.sliding_window, c.rope_theta, c.bos_token_id, c.eos_token_ids, c.tie_word_embeddings) == (
        None, 1e9, 1, (2,), False,
    )  # fmt: skip
    for theirs, ours in [
        ("language_model.model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("model.language_model.norm.weight", "model.norm.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("vision_tower.transformer.layers.0.attention.q_proj.weight", None),
        ("multi_modal_projector.linear_1.weight", None),
    ]:
        assert text_tensor_name(c, theirs) == ours, theirs


QWEN15_MOE: dict[str, Any] = {  # Qwen1.5-MoE-A2.7B's shape, as its config.json sets it
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "moe_intermediate_size": 1408,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "shared_expert_intermediate_size": 5632,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_config_qwen2_moe() -> None:
    """Qwen1.5-MoE: 60 experts of 1,408, four a token, not renormalized, in every layer, beside a
    shared expert of 5,632 and its one-row gate; Qwen2's q/k/v biases; a sliding window refused (no
    checkpoint has one, and transformers' rule for one is not Qwen2's)."""
    c = ModelConfig.from_hf_dict(QWEN15_MOE)
    assert (c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.norm_topk_prob) == (
        60,
        4,
        1408,
        False,
    )
    assert c.moe_layers == tuple(range(24)) and c.shared_expert_size == 5632 and c.sliding_window is None
    assert (c.attention_bias, c.o_proj_bias, c.qk_norm) == (True, False, False)
    shapes = expected_weight_shapes(c)
    assert shapes["model.layers.0.mlp.shared_expert.gate_proj.weight"] == (5632, 2048)
    assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert shapes["model.layers.23.mlp.experts.59.down_proj.weight"] == (2048, 1408)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (2048,)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({**QWEN15_MOE, "use_sliding_window": True})


def test_config_exaone4() -> None:
    """EXAONE 4.0: OLMo 2's blocks with q/k norms per head; with a window, three sliding layers in
    four (a number, "LLLG", or layer_types) and the global ones without RoPE; without one (null),
    every layer global and rotated."""
    base = {"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "hidden_size": 5120,
            "intermediate_size": 27392, "num_hidden_layers": 8, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 102400, "sliding_window": 4096, "sliding_window_pattern": "LLLG"}  # fmt: skip
    c = ModelConfig.from_hf_dict(base)
    assert (c.sandwich_norms, c.input_norms, c.qk_norm, c.qk_norm_whole, c.norm_weight_float32) == (
        True, False, True, False, False,
    )  # fmt: skip
    assert (c.sliding_window, c.sliding_window_layers, c.nope_layers) == (4096, (0, 1, 2, 4, 5, 6), (3, 7))
    assert ModelConfig.from_hf_dict({**base, "sliding_window_pattern": 4}).sliding_window_layers == (
        0,
        1,
        2,
        4,
        5,
        6,
    )
    typed = ModelConfig.from_hf_dict({**base, "layer_types": ["full_attention"] + ["sliding_attention"] * 7})
    assert (typed.sliding_window_layers, typed.nope_layers) == (tuple(range(1, 8)), (0,))
    flat = ModelConfig.from_hf_dict({**base, "sliding_window": None})
    assert (flat.sliding_window, flat.nope_layers) == (None, ())
    assert expected_weight_shapes(c)["model.layers.0.self_attn.q_norm.weight"] == (128,)
    with pytest.raises(UnsupportedModelError, match="must be made of L and G"):
        ModelConfig.from_hf_dict({**base, "sliding_window_pattern": "LLX"})


GEMMA_3_1B: dict[str, Any] = {  # google/gemma-3-1b-it's config.json
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 262144,
}


def test_config_gemma3() -> None:
    """Gemma 3 1B: GeGLU, norms scaling by 1 + weight on each block's input and output, q/k norms,
    embeddings times sqrt(1152), scores times 256 ** -0.5; five sliding layers (window 512, RoPE
    base 1e4) in six, the sixth full (1e6; transformers 5's rope_parameters read too, with a
    scaling the 4B+ models' linear factor 8); soft-capping (Gemma 2) and bidirectional attention refused."""
    c = ModelConfig.from_hf_dict(GEMMA_3_1B)
    assert (c.model_type, c.hidden_act, c.norm_offset, c.sandwich_norms, c.qk_norm) == (
        "gemma3_text", "gelu_pytorch_tanh", 1.0, True, True,
    )  # fmt: skip
    assert (c.embedding_scale, c.attention_scale) == (1152**0.5, 256**-0.5)
    assert (c.rope_theta, c.rope_scaling, c.sliding_rope_theta, c.sliding_window) == (1e6, None, 1e4, 512)
    assert c.sliding_window_layers == tuple(i for i in range(26) if (i + 1) % 6)
    assert c.tie_word_embeddings and not c.attention_bias and c.eos_token_ids == (1, 106)
    shapes = expected_weight_shapes(c)
    assert shapes["model.layers.0.pre_feedforward_layernorm.weight"] == (1152,)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (256,)
    assert "lm_head.weight" not in shapes
    v5 = {**GEMMA_3_1B, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}  # fmt: skip
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
        v5.pop(key)
    c5 = ModelConfig.from_hf_dict(v5)
    assert (c5.rope_theta, c5.rope_scaling, c5.sliding_rope_theta) == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
        1e4,
    )
    typed = ModelConfig.from_hf_dict(
        {**GEMMA_3_1B, "layer_types": ["full_attention"] * 25 + ["sliding_attention"]}
    )
    assert typed.sliding_window_layers == (25,)
    for change, message in (
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"sliding_window": None}, "sliding_window=None"),
        ({"hidden_activation": "relu"}, "hidden_act='relu'"),
    ):
        with pytest.raises(UnsupportedModelError, match=message):
            ModelConfig.from_hf_dict({**GEMMA_3_1B, **change})


def test_config_gemma1() -> None:
    """Gemma 2B / 7B (and CodeGemma): Llama's blocks with norms scaling by 1 + weight, GeGLU by the
    tanh approximation (the hub's older configs say "gelu": Gemma's own is the approximation, as
    transformers 4.x read it), embeddings times sqrt(hidden), head_dim 256, tied embeddings."""
    base = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 2048,
            "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
            "vocab_size": 256000, "hidden_act": "gelu", "bos_token_id": 2, "eos_token_id": 1}  # fmt: skip
    c = ModelConfig.from_hf_dict(base)
    assert (c.hidden_act, c.norm_offset, c.embedding_scale, c.head_dim, c.tie_word_embeddings) == (
        "gelu_pytorch_tanh", 1.0, 2048**0.5, 256, True,
    )  # fmt: skip
    assert (c.sandwich_norms, c.qk_norm, c.attention_scale, c.attn_logit_softcap) == (
        False,
        False,
        None,
        None,
    )
    newer = ModelConfig.from_hf_dict({**base, "hidden_activation": "gelu_pytorch_tanh"})
    assert newer.hidden_act == "gelu_pytorch_tanh"


GEMMA_2_2B: dict[str, Any] = {  # google/gemma-2-2b-it's config.json
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 256000,
}


def test_config_gemma2() -> None:
    """Gemma 2 2B: Gemma 3's block without q/k norms (GeGLU, norms scaling by 1 + weight on each
    block's input and output, embeddings times sqrt(2304), scores times 256 ** -0.5), one RoPE (1e4)
    for every layer, every other layer sliding (window 4096) from the first, scores capped at 50
    and logits at 30; the 27B's query scale (144) read; caps left out take transformers' defaults,
    a null cap is none."""
    c = ModelConfig.from_hf_dict(GEMMA_2_2B)
    assert (c.model_type, c.hidden_act, c.norm_offset, c.sandwich_norms, c.qk_norm) == (
        "gemma2", "gelu_pytorch_tanh", 1.0, True, False,
    )  # fmt: skip
    assert (c.embedding_scale, c.attention_scale) == (2304**0.5, 256**-0.5)
    assert (c.rope_theta, c.rope_scaling, c.sliding_rope_theta, c.sliding_window) == (1e4, None, None, 4096)
    assert c.sliding_window_layers == tuple(range(0, 26, 2))
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
    assert c.tie_word_embeddings and c.eos_token_ids == (1, 107) and c.max_position_embeddings == 8192
    shapes = expected_weight_shapes(c)
    assert shapes["model.layers.0.post_feedforward_layernorm.weight"] == (2304,)
    assert "model.layers.0.self_attn.q_norm.weight" not in shapes and "lm_head.weight" not in shapes
    big = ModelConfig.from_hf_dict({**GEMMA_2_2B, "query_pre_attn_scalar": 144, "head_dim": 128})
    assert big.attention_scale == 144**-0.5
    bare = {k: v for k, v in GEMMA_2_2B.items() if not k.endswith("softcapping")}
    assert (
        ModelConfig.from_hf_dict(bare).attn_logit_softcap,
        ModelConfig.from_hf_dict(bare).final_logit_softcap,
    ) == (50.0, 30.0)
    assert ModelConfig.from_hf_dict({**GEMMA_2_2B, "attn_logit_softcapping": None}).attn_logit_softcap is None
    for change, message in (
        ({"attn_logit_softcapping": 0}, "attn_logit_softcapping must be a positive number"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"sliding_window": None}, "sliding_window=None"),
    ):
        with pytest.raises(UnsupportedModelError, match=message):
            ModelConfig.from_hf_dict({**GEMMA_2_2B, **change})


GRANITE_3: dict[str, Any] = {  # the keys of ibm-granite/granite-3.x-instruct's config.json (2B's sizes)
    "architectures": ["GraniteForCausalLM"],
    "model_type": "granite",
    "attention_bias": False,
    "attention_multiplier": 0.015625,
    "bos_token_id": 0,
    "embedding_multiplier": 12.0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "logits_scaling": 8.0,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 49159,
}


def test_config_granite() -> None:
    """Granite 3: Llama's shape, its four multipliers read (the attention's replaces head_dim ** -0.5);
    left out, each is 1 (transformers' GraniteConfig); a non-positive one refused."""
    c = ModelConfig.from_hf_dict(GRANITE_3)
    assert (c.model_type, c.head_dim, c.num_kv_heads, c.tie_word_embeddings) == ("granite", 64, 8, True)
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_scale, c.logits_scaling) == (
        12.0, 0.22, 0.015625, 8.0,
    )  # fmt: skip
    assert (c.embedding_scale, c.norm_offset, c.sandwich_norms, c.qk_norm) == (None, 0.0, False, False)
    bare = ModelConfig.from_hf_dict(
        {k: v for k, v in GRANITE_3.items() if "multiplier" not in k and k != "logits_scaling"}
    )
    assert (bare.embedding_multiplier, bare.residual_multiplier, bare.attention_scale, bare.logits_scaling) == (
        1.0, 1.0, 1.0, 1.0,
    )  # fmt: skip
    for key in ("residual_multiplier", "logits_scaling"):
        with pytest.raises(UnsupportedModelError, match=f"{key} must be a positive number"):
            ModelConfig.from_hf_dict({**GRANITE_3, key: 0})


def test_config_smollm3() -> None:
    """SmolLM3: Llama's shape; the layers whose no_rope_layers flag is 0 are not rotated (every
    fourth by default, SmolLM3-3B's), and slide only where use_sliding_window says so."""
    base = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048,
            "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
            "vocab_size": 128256, "rope_theta": 5000000.0, "max_position_embeddings": 65536,
            "use_sliding_window": False, "sliding_window": None}  # fmt: skip
    c = ModelConfig.from_hf_dict(base)
    assert c.nope_layers == tuple(range(3, 36, 4)) and c.tie_word_embeddings and c.sliding_window is None
    flags = [1, 1, 0, 1] * 9
    assert ModelConfig.from_hf_dict({**base, "no_rope_layers": flags}).nope_layers == tuple(range(2, 36, 4))
    windowed = ModelConfig.from_hf_dict({**base, "use_sliding_window": True, "sliding_window": 4096})
    assert (windowed.sliding_window, windowed.sliding_window_layers) == (4096, c.nope_layers)
    with pytest.raises(
        UnsupportedModelError, match="no_rope_layers must hold a 0 or 1 for each of 36 layers"
    ):
        ModelConfig.from_hf_dict({**base, "no_rope_layers": [1, 0]})


GEMMA_3_4B: dict[str, Any] = {  # google/gemma-3-4b-it's config.json: the text model sets what differs
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_config_gemma3_image_text() -> None:
    """Gemma 3 4B-27B (image-text checkpoints): the language model of ``text_config``, whose unset
    keys take transformers' Gemma3TextConfig defaults, with the top level's token ids and dtype."""
    c = ModelConfig.from_hf_dict(GEMMA_3_4B)
    assert (c.architecture, c.model_type) == ("Gemma3ForConditionalGeneration", "gemma3_text")
    assert (c.hidden_size, c.intermediate_size, c.num_layers) == (2560, 10240, 34)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 256, 262208)
    assert (c.rope_theta, c.rope_scaling, c.sliding_rope_theta) == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
        1e4,
    )
    assert c.sliding_window == 1024 and c.sliding_window_layers == tuple(i for i in range(34) if (i + 1) % 6)
    assert (c.eos_token_ids, c.bos_token_id, c.torch_dtype) == ((1, 106), 2, "bfloat16")
    assert c.tie_word_embeddings and c.attention_scale == 256**-0.5 and c.hidden_act == "gelu_pytorch_tanh"
    assert c.max_position_embeddings == 131072 and c.embedding_scale == 2560**0.5
    with pytest.raises(UnsupportedModelError, match="needs a text_config"):
        ModelConfig.from_hf_dict({k: v for k, v in GEMMA_3_4B.items() if k != "text_config"})


@pytest.mark.parametrize(
    "text",
    [
        GEMMA_3_4B["text_config"],
        {},  # every key its default
        # 27B's shape: heads of 128, its own query scale
        {
            "head_dim": 128,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_attention_heads": 32,
            "num_hidden_layers": 62,
            "num_key_value_heads": 16,
            "query_pre_attn_scalar": 168,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
    ],  # fmt: skip
    ids=["4b", "defaults", "27b-shape"],
)
def test_image_text_defaults_are_transformers_own(text: dict[str, Any]) -> None:
    """What a text_config leaves out is read as transformers' Gemma3TextConfig fills it in."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma3Config(text_config=dict(text)).text_config
    c = ModelConfig.from_hf_dict({**GEMMA_3_4B, "text_config": text})
    pattern = [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"]
    rope = hf.rope_parameters
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
    )  # fmt: skip
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position_embeddings, c.rms_norm_eps) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.max_position_embeddings, hf.rms_norm_eps,
    )  # fmt: skip
    assert (c.hidden_act, c.attention_scale, c.sliding_window, list(c.sliding_window_layers)) == (
        hf.hidden_activation, hf.query_pre_attn_scalar**-0.5, hf.sliding_window, pattern,
    )  # fmt: skip
    assert (c.rope_theta, c.sliding_rope_theta) == (
        rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"],
    )  # fmt: skip


def test_config_qwen3() -> None:
    """Qwen3: no biases unless attention_bias (then on the output projection too), a head width of
    its own (128 where config.json says none, as transformers' Qwen3Config), q/k norms."""
    q = ModelConfig.from_hf_dict(QWEN3_06B)
    assert q.model_type == "qwen3" and q.qk_norm and q.tie_word_embeddings
    assert (q.head_dim, q.num_heads * q.head_dim, q.hidden_size) == (128, 2048, 1024)
    assert (q.attention_bias, q.o_proj_bias, q.mlp_bias, q.sliding_window) == (False, False, False, None)
    assert q.eos_token_ids == (151645,) and q.rope_theta == 1e6
    biased = ModelConfig.from_hf_dict({**QWEN3_06B, "attention_bias": True})
    assert (biased.attention_bias, biased.o_proj_bias) == (True, True)
    no_head_dim = {k: v for k, v in QWEN3_06B.items() if k != "head_dim"}
    assert ModelConfig.from_hf_dict(no_head_dim).head_dim == 128
    sliding = ModelConfig.from_hf_dict({**QWEN3_06B, "use_sliding_window": True, "sliding_window": 4096,
                                        "max_window_layers": 26})  # fmt: skip
    assert sliding.sliding_window_layers == (26, 27)
    shapes = expected_weight_shapes(q)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.layers.27.self_attn.k_norm.weight"] == (128,)
    assert not ModelConfig.from_hf_dict(QWEN25_05B).qk_norm


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration, Gemma2ForCausalLM, GemmaForCausalLM, GraniteForCausalLM, SmolLM3ForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, Exaone4ForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM",
        ),
        ({"architectures": None, "model_type": "gpt2"}, "model_type='gpt2'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5}}, "yarn scaling needs a factor >= 1"),
        ({"rope_scaling": {"rope_type": "linear"}}, "positive 'factor'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 5}, "not a multiple"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_config_rejects_unsupported(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict({**LLAMA_31_8B, **change})


def test_config_from_dir_merges_generation_config_eos(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, eos_token_id=4)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4, 3]}))
    assert ModelConfig.from_dir(model_dir).eos_token_ids == (4, 1, 3)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path / "nowhere")


def test_sharded_round_trip(tmp_path: Path) -> None:
    single = make_tiny_checkpoint(tmp_path / "single", seed=5)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", seed=5, num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    # The shards hold exactly the single file's tensors, byte for byte.
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(load_file(sharded / shard))
    reference = load_file(single / "model.safetensors")
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in reference)
    # Both load into identical models.
    a, _ = load_model(single, CPU, torch.float32)
    b, _ = load_model(sharded, CPU, torch.float32)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    for name, tensor in reference.items():
        assert torch.equal(sd_a[name], tensor)


def test_image_text_checkpoints_load_their_language_model_in_either_layout(tmp_path: Path) -> None:
    """An image-text checkpoint's language model loads from ``language_model.model.*`` (Google's
    uploads, transformers' saving) and from ``model.language_model.*`` (transformers 4.52-4.57),
    its vision tower and projector skipped; a tensor that is neither is still refused."""
    first = make_tiny_checkpoint(tmp_path / "a", "gemma3", seed=2)
    stored = load_file(first / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in stored)
    assert any(k.startswith("multi_modal_projector.") for k in stored)
    model, config = load_model(first, CPU, torch.float32)
    assert text_tensor_name(config, "language_model.model.norm.weight") == "model.norm.weight"
    assert text_tensor_name(config, "language_model.lm_head.weight") == "lm_head.weight"
    assert text_tensor_name(config, "vision_tower.vision_model.post_layernorm.weight") is None
    assert text_tensor_name(ModelConfig.from_hf_dict(GEMMA_3_1B), "vision_tower.x") == "vision_tower.x"
    second = tmp_path / "b"
    second.mkdir()
    for f in first.iterdir():
        if f.name != "model.safetensors":
            (second / f.name).write_bytes(f.read_bytes())
    renamed = {
        ("model." + k.replace("language_model.model.", "language_model.", 1)): v for k, v in stored.items()
    }
    save_file(renamed, str(second / "model.safetensors"), metadata={"format": "pt"})
    again, _ = load_model(second, CPU, torch.float32)
    theirs = dict(again.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, theirs[name]), name
    assert torch.equal(model.model.embed_tokens.weight, stored["language_model.model.embed_tokens.weight"])
    save_file(
        {**stored, "audio_tower.x": torch.zeros(2)},
        str(second / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with pytest.raises(CheckpointError, match="unexpected tensor 'audio_tower.x'"):
        load_model(second, CPU, torch.float32)


def test_tied_embeddings_share_storage(tmp_path: Path) -> None:
    tied, config = load_model(make_tiny_checkpoint(tmp_path / "t", "qwen2"), CPU, torch.float32)
    assert config.tie_word_embeddings
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied, _ = load_model(make_tiny_checkpoint(tmp_path / "u", "llama"), CPU, torch.float32)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_dtype_cast_and_inference_mode(tmp_path: Path) -> None:
    model, _ = load_model(make_tiny_checkpoint(tmp_path), CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_missing_and_bad_weight_files(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")

    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        load_model(model_dir, CPU, torch.float32)
    (model_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="convert them to safetensors"):
        load_model(model_dir, CPU, torch.float32)

    partial = dict(tensors)
    del partial["model.layers.1.mlp.up_proj.weight"]
    save_file(partial, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks tensor\\(s\\): model.layers.1.mlp.up_proj.weight"):
        load_model(model_dir, CPU, torch.float32)

    save_file(
        {**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)},
        str(model_dir / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        load_model(model_dir, CPU, torch.float32)

    save_file({**tensors, "model.norm.weight": torch.ones(65)}, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="has shape \\(65,\\), config.json implies \\(64,\\)"):
        load_model(model_dir, CPU, torch.float32)

    sharded = make_tiny_checkpoint(tmp_path / "s", num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00002.safetensors"):
        load_model(sharded, CPU, torch.float32)


def test_unsupported_architecture_dir(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["PhiForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="supported architectures: LlamaForCausalLM"):
        load_model(model_dir, CPU, torch.float32)


def test_extra_tied_copy_and_rotary_tables_are_ignored(tmp_path: Path) -> None:
    """Some tied checkpoints store lm_head.weight anyway, old ones store rotary inv_freq."""
    model_dir = make_tiny_checkpoint(tmp_path, "qwen2")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(model_dir / "model.safetensors"))
    model, _ = load_model(model_dir, CPU, torch.float32)
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_default_device_and_dtype() -> None:
    device, dtype = default_device_and_dtype()
    if torch.cuda.is_available():
        assert (device.type, dtype) == ("cuda", torch.bfloat16)
    else:
        assert (device, dtype) == (CPU, auto_dtype(CPU))  # the machine's flags decide


def test_loaded_model_runs(tmp_path: Path) -> None:
    model, config = load_model(
        make_tiny_checkpoint(tmp_path, "mistral", sliding_window=4), CPU, torch.float32
    )
    (logits,) = PagedRunner(model, 8, 4).step([(0, [0, 10, 20, 30, 40, 50])])
    assert logits.shape == (6, config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YUTU_CACHE_DIR", str(tmp_path / "cache"))
    default = resolve_model(None)
    assert default == tmp_path / "cache" / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"
    assert (default / "config.json").is_file()

    local = make_tiny_checkpoint(tmp_path / "local")
    assert resolve_model(str(local)) == local
    with pytest.raises(ValueError, match="holds no config.json"):
        resolve_model(str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="does not exist: pass an existing local directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(str(local / "config.json"))


def test_resolve_unreadable_model_dir_says_how_to_fix_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint copied in as root with mode 0700 (the tests run as root, so the error is injected)."""
    local = make_tiny_checkpoint(tmp_path / "local")

    def denied(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", denied)
    with pytest.raises(ValueError, match=r"cannot read model directory .*Permission denied.*chmod -R a\+rX"):
        resolve_model(str(local))


def test_resolve_unreachable_hub_id() -> None:
    """No network in tests (and the repo does not exist): the error says to pass a local directory."""
    with pytest.raises(ValueError, match="pass the local directory"):
        resolve_model("yutu-test-no-such-org/no-such-model-7f3a")


def test_tiny_config_rejects_unknown_arch() -> None:
    with pytest.raises(
        ValueError,
        match="arch must be one of llama, qwen2, qwen3, mistral, phi3, gemma3_text, gemma, gemma2, granite, smollm3, olmo2, olmo3, exaone4, qwen3_moe, qwen2_moe, mixtral",
    ):
        tiny_hf_config("gpt2")
