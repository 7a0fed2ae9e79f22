"""The model's shape, read once from a Hugging Face ``config.json``.

``ModelConfig`` is the only place that knows the quirks of each supported architecture (which
projections carry a bias, where RoPE settings live, which layers use a sliding window). Everything
downstream -- model, loader, engine -- reads plain fields.

Supported:

- ``LlamaForCausalLM`` (Llama 2/3; RoPE scaled linearly, by llama3's rule or by YaRN, as any of
  these may be); ``Qwen2ForCausalLM`` (q/k/v bias, optionally tied embeddings);
  ``Qwen3ForCausalLM`` (Qwen2's shape without the biases, each query and key head RMS-normalized
  before its rotation); ``MistralForCausalLM`` (sliding-window attention);
- ``Phi3ForCausalLM`` (Phi-3, Phi-3.5, Phi-4, Phi-4-mini: Llama's shape with q/k/v and gate/up each
  stored as one fused tensor, a sliding window on every layer where set; LongRoPE, by its short
  factors up to its pretraining length or its long ones for a longer context, see
  ``ModelConfig.for_context``; Phi-4-mini's partial rotation);
- ``Gemma3ForCausalLM`` (Gemma 3's text models: GELU-gated MLPs, RMSNorms scaling by 1 + weight, a
  norm on each block's output as well as its input, q/k norms, embeddings scaled by sqrt(hidden),
  five sliding layers in six with a RoPE base of their own); ``GemmaForCausalLM`` (Gemma and
  CodeGemma: Llama's blocks with Gemma's MLPs, norms and embedding scale); ``Gemma2ForCausalLM``
  (Gemma 2: Gemma 3's norms, MLPs and scales without its q/k norms, one RoPE for every layer, every
  other layer sliding, attention scores and the output logits soft-capped: ``cap * tanh(x / cap)``);
- the language model of an image-text checkpoint, its vision tower not loaded:
  ``Gemma3ForConditionalGeneration`` (Gemma 3 4B-27B: Gemma 3's text model) and
  ``Mistral3ForConditionalGeneration`` (Mistral Small 3.1 and 3.2: Mistral's);
- ``GraniteForCausalLM`` (IBM's Granite 3: Llama's shape with four multipliers -- the embedding's
  output, each block's output before the residual add, the attention scores in place of
  head_dim ** -0.5, and the logits divided); ``SmolLM3ForCausalLM`` (Llama's shape, every fourth
  layer without RoPE: ``no_rope_layers``);
- ``Olmo2ForCausalLM`` (OLMo 2: each block's output normalized before the residual add and its
  input not, queries and keys normalized across all heads before their rotation);
  ``Olmo3ForCausalLM`` (OLMo 3: OLMo 2 with three sliding layers in four, whose rotation is never
  scaled); ``Exaone4ForCausalLM`` (EXAONE 4.0: OLMo 2's blocks with q/k norms per head; three
  sliding layers in four, the fourth global and without RoPE);
- three sparse mixtures of experts: ``Qwen3MoeForCausalLM`` (Qwen3's attention; ``num_experts``
  SwiGLU experts, ``num_experts_per_tok`` per token, in the layers ``decoder_sparse_step`` and
  ``mlp_only_layers`` leave sparse), ``Qwen2MoeForCausalLM`` (Qwen1.5-MoE, Qwen2-57B-A14B: Qwen2's
  attention, the same experts, and a shared expert every token goes through, weighted by a sigmoid
  gate of its own) and ``MixtralForCausalLM`` (Mistral's attention; ``num_local_experts`` experts
  in every layer, the top ones' weights renormalized).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    # architecture name in config.json -> model_type
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3_text",  # image-text (4B-27B): its language model only
    "Mistral3ForConditionalGeneration": "mistral",  # image-text (Mistral Small 3.1, 3.2): the same
    "Gemma2ForCausalLM": "gemma2",
    "GemmaForCausalLM": "gemma",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Exaone4ForCausalLM": "exaone4",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
# Image-text checkpoints whose language model is served alone (images are refused at the gateway):
# the config's ``text_config``, over these defaults of the text model's config class (transformers'
# Gemma3TextConfig: Google's 4B-27B configs set only what differs from them; MistralConfig), and
# the top level's token ids, dtype and tying. Their tensors are renamed on load
# (yutu.engine.loader.text_tensor_name).
IMAGE_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "Mistral3ForConditionalGeneration": {
        "vocab_size": 32_000,
        "hidden_size": 4096,
        "intermediate_size": 14_336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": 10_000.0,
        "sliding_window": 4096,
    },
    "Gemma3ForConditionalGeneration": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "rope_theta": 1_000_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,
    },
}
_TOP_LEVEL_KEYS = ("bos_token_id", "eos_token_id", "torch_dtype", "dtype", "tie_word_embeddings")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # an MLP's gate: SwiGLU, or GeGLU (Gemma)


class UnsupportedModelError(ValueError):
    """The checkpoint's config.json describes a model this engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES, e.g. "LlamaForCausalLM"
    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # residual stream width
    intermediate_size: int  # SwiGLU inner width
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int  # width of one head (need not equal hidden_size // num_heads)
    max_position_embeddings: int  # longest context the model supports
    rms_norm_eps: float  # epsilon inside RMSNorm
    rope_theta: float  # RoPE base wavelength
    rope_scaling: dict[str, Any] | None  # None: plain RoPE; else {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool  # LM head shares the embedding matrix
    attention_bias: bool  # q/k/v projections carry a bias
    bos_token_id: int | None  # beginning-of-sequence token, if the model has one
    eos_token_ids: tuple[int, ...]  # tokens that end generation (config + generation_config)
    torch_dtype: str | None  # dtype the checkpoint was saved in ("bfloat16", ...), informational
    o_proj_bias: bool = False  # the output projection carries a bias (Llama with attention_bias)
    mlp_bias: bool = False  # gate/up/down projections carry a bias (Llama mlp_bias)
    sliding_window: int | None = None  # attention window in tokens for sliding layers, None: full
    sliding_window_layers: tuple[int, ...] = ()  # indices of layers that use sliding_window
    qk_norm: bool = False  # each query and key head is RMS-normalized before RoPE (Qwen3)
    qk_norm_whole: bool = False  # ... across all heads at once instead, weights of nh*hd / kvh*hd (OLMo 2)
    input_norms: bool = True  # each block's input normalized; False with sandwich_norms: OLMo 2's blocks
    norm_weight_float32: bool = False  # RMSNorm's weight multiplied before rounding to the dtype (OLMo 2)
    # Sparse mixture of experts (Qwen3-MoE, Mixtral): in moe_layers, the MLP is num_experts SwiGLU
    # experts of moe_intermediate_size, experts_per_token of them per token, chosen by a router's
    # softmax and weighted by it (renormalized over the chosen where norm_topk_prob).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    shared_expert_size: int = 0  # Qwen2-MoE: a SwiGLU expert of this width beside them, sigmoid-gated
    # Gemma 3: the MLP gate's activation; RMSNorm scaling by (norm_offset + weight); a norm on each
    # block's output before the residual add, besides the one on its input (sandwich_norms); the
    # embedding's output times embedding_scale; attention scores times attention_scale (None:
    # head_dim ** -0.5); the sliding layers' RoPE base (None: rope_theta and rope_scaling as the others).
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embedding_scale: float | None = None
    attention_scale: float | None = None
    sliding_rope_theta: float | None = None
    rotary_dim: int | None = None  # RoPE rotates each head's first rotary_dim dims (Phi-4-mini); None: all
    # Gemma 2: attention scores (after their scale) and the output logits soft-capped, cap * tanh(x / cap)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Granite: the embedding's output times embedding_multiplier (unrounded, unlike Gemma's scale),
    # each block's output times residual_multiplier before the residual add, logits divided by
    # logits_scaling (its attention_multiplier is attention_scale)
    embedding_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    nope_layers: tuple[int, ...] = ()  # layers whose queries and keys are not rotated (SmolLM3's NoPE)
    yutu_demo: bool = False  # the built-in demo model: random weights, meaningless text

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; check config.json"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE; check config.json")
        if not (2 <= self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise UnsupportedModelError(
                f"RoPE would rotate {self.rope_dim} of each head's {self.head_dim} dims: it needs an even"
                " number, at least 2 (check partial_rotary_factor in config.json)"
            )
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.rope_dim // 2:
                    raise UnsupportedModelError(
                        f"longrope {key} has {len(self.rope_scaling[key])} entries; {self.rope_dim} rotated"
                        f" dims (head_dim={self.head_dim}) need {self.rope_dim // 2}: check config.json"
                    )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act={self.hidden_act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.moe_layers and not 1 <= self.experts_per_token <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.experts_per_token} must be in [1, {self.num_experts}] (the"
                " experts); check config.json"
            )

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rope_dim(self) -> int:
        """How many of each head's dims RoPE rotates (the first ones)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def longrope_regime(self) -> str | None:
        """Which of LongRoPE's factors rotate every sequence: ``"short"`` (the default, up to the
        pretraining length) or ``"long"`` (see :meth:`for_context`); None without LongRoPE."""
        if self.rope_scaling is None or self.rope_scaling["rope_type"] != "longrope":
            return None
        return "long" if self.rope_scaling.get("long") else "short"

    def for_context(self, max_model_len: int | None) -> ModelConfig:
        """This config for an engine whose contexts reach ``max_model_len`` (None: the default).
        A LongRoPE model asked for more than its pretraining length rotates *every* sequence by its
        long factors (see ``_longrope``): one rotation for every key a sequence caches, and for every
        block key the prefix cache shares."""
        scaling = self.rope_scaling
        if self.longrope_regime != "short" or max_model_len is None:
            return self
        assert scaling is not None
        if max_model_len <= scaling["original_max_position_embeddings"]:
            return self
        return replace(self, rope_scaling={**scaling, "long": True})

    @property
    def positions_served(self) -> int:
        """The longest context the engine runs this model at: ``max_position_embeddings``, or for
        LongRoPE by its short factors its pretraining length (see ``_longrope``)."""
        if self.longrope_regime == "short":
            assert self.rope_scaling is not None
            return min(self.max_position_embeddings, self.rope_scaling["original_max_position_embeddings"])
        return self.max_position_embeddings

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens, or None when it attends to the whole context."""
        return self.sliding_window if layer in self.sliding_window_layers else None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the paged KV cache tensor (see yutu.engine.attention)."""
        return (num_blocks, self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)

    def kv_block_numel(self, block_size: int) -> int:
        """Elements in one KV block of all layers: one store object."""
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: Path | str) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra EOS ids) from a model dir."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{config_file} not found: pass a Hugging Face model directory that holds config.json"
            )
        d = json.loads(config_file.read_text(encoding="utf-8"))
        gen_file = path / "generation_config.json"
        extra_eos: tuple[int, ...] = ()
        if gen_file.is_file():
            extra_eos = _as_id_tuple(json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id"))
        config = cls.from_hf_dict(d)
        merged = tuple(dict.fromkeys(config.eos_token_ids + extra_eos))
        return replace(config, eos_token_ids=merged)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``; raise UnsupportedModelError if unusable."""
        architecture = _architecture(d)
        if architecture in IMAGE_TEXT_DEFAULTS:
            d = _language_model(d, architecture)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        gemma3, gemma2, gemma1 = model_type == "gemma3_text", model_type == "gemma2", model_type == "gemma"
        gemma = gemma3 or gemma2 or gemma1
        olmo = model_type in ("olmo2", "olmo3")
        exaone4 = model_type == "exaone4"
        hidden_act = (d.get("hidden_activation") if gemma else None) or d.get("hidden_act", "silu")
        if (
            gemma1 and hidden_act == "gelu"
        ):  # Gemma's own is the tanh approximation (transformers 4.x's reading)
            hidden_act = "gelu_pytorch_tanh"
        num_heads = int(d["num_attention_heads"])
        hidden_size = int(d["hidden_size"])
        num_layers = int(d["num_hidden_layers"])
        # Qwen3's config defaults head_dim to 128 (transformers' Qwen3Config), Gemma 3's to 256, not
        # hidden / heads.
        default_head_dim = {"qwen3": 128, "gemma3_text": 256, "gemma2": 256, "gemma": 256}.get(
            model_type, hidden_size // num_heads
        )
        head_dim = d.get("head_dim") or default_head_dim
        qwen3_family = model_type in ("qwen3", "qwen3_moe")
        rope_theta, rope_scaling = (
            _gemma3_rope(d) if gemma3 else _olmo3_rope(d) if model_type == "olmo3" else _rope(d)
        )
        rotary_dim = int(int(head_dim) * _partial_rotary(d, model_type))

        # Which projections carry a bias differs per architecture.
        if model_type in ("qwen2", "qwen2_moe"):  # q/k/v only (Qwen2-MoE's qkv_bias, true by default)
            attention_bias, o_proj_bias, mlp_bias = bool(d.get("qkv_bias", True)), False, False
        elif model_type in ("mistral", "mixtral", "phi3"):
            attention_bias, o_proj_bias, mlp_bias = False, False, False
        elif qwen3_family or gemma:  # one switch for q/k/v and the output projection
            attention_bias = o_proj_bias = bool(d.get("attention_bias", False))
            mlp_bias = False
        else:
            attention_bias = bool(d.get("attention_bias", False))
            o_proj_bias = attention_bias
            mlp_bias = bool(d.get("mlp_bias", False))

        sliding_window, sliding_layers = _sliding_window(d, model_type, num_layers)
        return cls(
            architecture=architecture,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=_context(d, rope_scaling),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(
                d.get("tie_word_embeddings", gemma or model_type == "smollm3")
            ),  # HF's defaults
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            sliding_window=sliding_window,
            sliding_window_layers=sliding_layers,
            qk_norm=qwen3_family or gemma3 or olmo or exaone4,
            **(_olmo(d, model_type, rope_theta) if olmo else {}),
            **(_POST_NORMS_ONLY if exaone4 else {}),  # and q/k norms per head
            rotary_dim=rotary_dim,
            **_experts(d, model_type, num_layers),
            hidden_act=str(hidden_act),
            **(_gemma3(d, hidden_size) if gemma3 else _gemma2(d, hidden_size) if gemma2 else {}),
            **({"norm_offset": 1.0, "embedding_scale": hidden_size**0.5} if gemma1 else {}),
            **(_granite(d) if model_type == "granite" else {}),
            nope_layers=_nope_layers(d, num_layers)
            if model_type == "smollm3"
            else _exaone4_nope(sliding_layers, num_layers)
            if exaone4 and sliding_window is not None
            else (),
            yutu_demo=bool(d.get("yutu_demo", False)),
        )


def _context(d: dict[str, Any], rope_scaling: dict[str, Any] | None) -> int:
    """The longest context the model supports: ``max_position_embeddings``, or with YaRN the
    pretraining length times its factor where that is longer (Qwen3's configs keep 40,960 beside a
    4x YaRN over 32,768: 131,072, as vLLM derives it)."""
    stated = int(d.get("max_position_embeddings", 2048))
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        return max(stated, int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"]))
    return stated


def _architecture(d: dict[str, Any]) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    if archs:
        raise UnsupportedModelError(
            f"architecture {archs[0]!r} is not supported; supported architectures: {supported}"
        )
    # No "architectures" list: fall back on model_type.
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    model_type = d.get("model_type")
    if model_type in by_type:
        return by_type[model_type]
    raise UnsupportedModelError(
        f"config.json names no supported architecture (model_type={model_type!r}); "
        f"supported architectures: {supported}"
    )


def _language_model(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The config of an image-text checkpoint's language model (see IMAGE_TEXT_DEFAULTS)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(
            f"{architecture} needs a text_config object in config.json (its language model's settings)"
        )
    top = {k: d[k] for k in _TOP_LEVEL_KEYS if d.get(k) is not None}
    return {**IMAGE_TEXT_DEFAULTS[architecture], **text, **top}


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config shape.

    transformers 4.x writes ``rope_theta`` and ``rope_scaling`` at the top level; transformers 5.x
    writes one ``rope_parameters`` dict holding ``rope_theta``, ``rope_type`` and the scaling keys.
    """
    params: dict[str, Any] = dict(d.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported by Llama-family models")
    scaling = d.get("rope_scaling")
    if scaling:
        params = {**params, **scaling}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), {"rope_type": "linear", "factor": _positive(params, "factor")}
    if rope_type == "longrope":
        return float(theta), _longrope(d, params)
    if rope_type == "yarn":
        return float(theta), _yarn(d, params)
    # llama3: HF defaults original_max_position_embeddings to max_position_embeddings.
    original = params.get("original_max_position_embeddings") or d.get("max_position_embeddings", 2048)
    low, high = _positive(params, "low_freq_factor"), _positive(params, "high_freq_factor")
    if not high > low:
        raise UnsupportedModelError(
            f"llama3 rope scaling needs high_freq_factor > low_freq_factor ({high}, {low})"
        )
    return float(theta), {
        "rope_type": "llama3",
        "factor": _positive(params, "factor"),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(original),
    }


def _partial_rotary(d: dict[str, Any], model_type: str) -> float:
    """The fraction of each head that RoPE rotates (``partial_rotary_factor``, top level or in
    ``rope_parameters``): Phi-3's layout rotates the first part and passes the rest (Phi-4-mini:
    0.75); 1.0 for every other architecture here."""
    factor = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if factor is None or float(factor) == 1.0:
        return 1.0
    if model_type != "phi3" or not 0.0 < float(factor) < 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor={factor} is not supported here (only Phi-3's, in (0, 1])"
        )
    return float(factor)


def _longrope(d: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE (Phi-3 128k, Phi-3.5): frequencies divided by ``short_factor`` up to the pretraining
    length and by ``long_factor`` past it, cos and sin scaled by ``attention_factor`` (by default
    sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original, as
    transformers computes it). transformers and vLLM switch factors by the length of the forward,
    which would rotate a sequence's new tokens unlike the keys it already cached (and make a
    prefix's KV depend on the request it came with); here the regime is the engine's
    (``ModelConfig.for_context``): by default the short factors up to the pretraining length
    (``ModelConfig.positions_served``), and for an engine asked for a longer ``max_model_len`` the
    long factors for every sequence, short ones included -- as transformers rotates a sequence
    longer than the pretraining length."""
    original = params.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if not original or int(original) <= 0:
        raise UnsupportedModelError("longrope scaling needs a positive original_max_position_embeddings")
    original = int(original)
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or not value or not all(float(f) > 0 for f in value):
            raise UnsupportedModelError(
                f"longrope scaling needs {key}: a list of positive numbers, got {value!r}"
            )
        factors[key] = [float(f) for f in value]
    factor = params.get("factor") or int(d.get("max_position_embeddings", original)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


def _yarn(d: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """YaRN (Qwen3 and QwQ's long contexts, OLMo 3): frequencies blended between the original ones
    (high, kept) and the ones divided by ``factor`` (low, interpolated) along a ramp between the dims
    that turn ``beta_fast`` and ``beta_slow`` times in ``original_max_position_embeddings``; cos and
    sin times ``attention_factor`` (by default 0.1 ln(factor) + 1, or the ratio of that with
    ``mscale`` and ``mscale_all_dim``), as transformers computes them -- for every position alike, so
    the context the model is served at, ``original_max_position_embeddings * factor``, changes no
    rotation (see ``ModelConfig.from_hf_dict``)."""
    original = params.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    original = int(original or d.get("max_position_embeddings", 2048))
    factor = params.get("factor")
    factor = (
        float(factor) if factor is not None else int(d.get("max_position_embeddings", original)) / original
    )
    if not math.isfinite(factor) or factor < 1.0:
        raise UnsupportedModelError(f"yarn scaling needs a factor >= 1, got {factor!r}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": bool(params.get("truncate", True)),
        "attention_factor": float(attention_factor),
    }


def _gemma3_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's full-attention layers' (rope_theta, rope_scaling): ``rope_parameters``'
    ``full_attention`` entry (transformers 5), else the top-level keys (4.x; 1e6 by default)."""
    params = d.get("rope_parameters") or {}
    full = params.get("full_attention")
    if full is not None:
        return _rope({"rope_parameters": {"rope_theta": 1_000_000.0, **full}})
    return _rope({"rope_theta": 1_000_000.0, **{k: d[k] for k in ("rope_theta", "rope_scaling") if k in d}})


def _gemma3(d: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """The ModelConfig fields particular to Gemma 3 (its sliding layers' RoPE base among them)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise UnsupportedModelError(
                f"{key}={d[key]} is not supported for Gemma 3 (it sets none; Gemma 2 does, as Gemma2ForCausalLM)"
            )
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "use_bidirectional_attention is not supported: a decoder attends causally"
        )
    local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(
            f"sliding layers' rope_type={local['rope_type']!r} is not supported (only default)"
        )
    return {
        **_gemma_block(d, hidden_size),
        "sliding_rope_theta": float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
    }


def _gemma2(d: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """The ModelConfig fields particular to Gemma 2: Gemma's block, and its soft caps (transformers'
    Gemma2Config defaults: 50 on attention scores, 30 on the logits; None: no cap)."""
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "use_bidirectional_attention is not supported: a decoder attends causally"
        )
    caps = {}
    for key, field_name, default in (
        ("attn_logit_softcapping", "attn_logit_softcap", 50.0),
        ("final_logit_softcapping", "final_logit_softcap", 30.0),
    ):
        value = d.get(key, default)
        if value is not None and (not math.isfinite(float(value)) or float(value) <= 0):
            raise UnsupportedModelError(f"{key} must be a positive number or null, got {value!r}")
        caps[field_name] = None if value is None else float(value)
    return {**_gemma_block(d, hidden_size), **caps}


def _olmo(d: dict[str, Any], model_type: str, rope_theta: float) -> dict[str, Any]:
    """OLMo 2 and 3's blocks: ``post_attention_layernorm`` and ``post_feedforward_layernorm`` on each
    block's output, none on its input; q/k norms across all heads; norms rounding after the weight.
    OLMo 3's sliding layers rotate by the full layers' base, unscaled (its YaRN is the full layers')."""
    fields: dict[str, Any] = {"sandwich_norms": True, "input_norms": False, "qk_norm_whole": True,
                              "norm_weight_float32": True}  # fmt: skip
    if model_type == "olmo3":
        local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(
                f"sliding layers' rope_type={local['rope_type']!r} is not supported (only default)"
            )
        fields["sliding_rope_theta"] = float(local.get("rope_theta", rope_theta))
    return fields


def _olmo3_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """OLMo 3's full layers' (rope_theta, rope_scaling): ``rope_parameters``' ``full_attention``
    entry (transformers 5), else the top-level keys (4.x: its rope_scaling is the full layers')."""
    full = (d.get("rope_parameters") or {}).get("full_attention")
    if full is not None:
        return _rope({**d, "rope_parameters": full, "rope_scaling": None})
    return _rope(d)


# EXAONE 4.0's blocks: OLMo 2's norms (each block's output normalized, its input not)
_POST_NORMS_ONLY: dict[str, Any] = {"sandwich_norms": True, "input_norms": False}


def _exaone4_nope(sliding: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """EXAONE 4.0's global layers, which attend without RoPE where the model has sliding ones."""
    return tuple(i for i in range(num_layers) if i not in sliding)


def _exaone4_layer_types(d: dict[str, Any], num_layers: int) -> list[str]:
    """EXAONE 4.0's layer types: ``layer_types``, else ``sliding_window_pattern`` -- a number n (all
    but each n-th layer sliding; 4 by default) or a string such as ``"LLLG"`` (L: sliding, G: global),
    repeated over the layers."""
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    pattern = d.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise UnsupportedModelError(f"sliding_window_pattern={pattern!r} must be made of L and G")
        return [
            "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
            for i in range(num_layers)
        ]
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers)]


def _nope_layers(d: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` (1 rotates, 0 does not), else every
    ``no_rope_layer_interval``-th (4; transformers' SmolLM3Config)."""
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise UnsupportedModelError(
            f"no_rope_layers must hold a 0 or 1 for each of {num_layers} layers, got {flags!r}"
        )
    return tuple(i for i, flag in enumerate(flags) if not flag)


def _granite(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (transformers' GraniteConfig defaults: 1.0 each)."""
    values = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        value = d.get(key, 1.0)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise UnsupportedModelError(f"{key} must be a positive number, got {value!r}")
        values[key] = float(value)
    return {
        "embedding_multiplier": values["embedding_multiplier"],
        "residual_multiplier": values["residual_multiplier"],
        "attention_scale": values["attention_multiplier"],
        "logits_scaling": values["logits_scaling"],
    }


def _gemma_block(d: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """Gemma's (2 and 3): RMSNorms scaling by 1 + weight, a norm on each block's output too, the
    embedding's output times sqrt(hidden), queries scaled by query_pre_attn_scalar ** -0.5."""
    return {
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embedding_scale": hidden_size**0.5,
        "attention_scale": float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
    }


def _positive(params: dict[str, Any], key: str) -> float:
    value = params.get(key)
    if value is None or not math.isfinite(float(value)) or float(value) <= 0:
        raise UnsupportedModelError(f"rope scaling needs a positive {key!r}, got {value!r}")
    return float(value)


def _sliding_window(
    d: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[int, ...]]:
    window = d.get("sliding_window")
    if model_type in ("gemma3_text", "gemma2", "olmo3"):  # every model of these sets it
        window = d.get("sliding_window", 4096)  # transformers' default in each of their configs
        if window is None:
            raise UnsupportedModelError(f"sliding_window=None is not supported for {model_type}")
    if model_type == "exaone4":  # transformers' Exaone4Config default; null: no sliding layer
        window = d.get("sliding_window", 4096)
    if model_type in ("llama", "olmo2") or window is None:
        return None, ()
    if (
        model_type == "qwen2_moe"
    ):  # no Qwen2-MoE checkpoint slides; transformers' rule for one is unlike Qwen2's
        if d.get("use_sliding_window", False):
            raise UnsupportedModelError("use_sliding_window is not supported for Qwen2-MoE")
        return None, ()
    if model_type == "qwen3_moe":  # every layer, where use_sliding_window (transformers' Qwen3Moe)
        layers = tuple(range(num_layers)) if d.get("use_sliding_window", False) else ()
    elif model_type in ("gemma3_text", "gemma2"):  # layer_types, else all but each pattern-th layer
        layer_types = d.get("layer_types")
        if layer_types is None:  # Gemma 3: five in six; Gemma 2: every other, from the first
            pattern = int(d.get("sliding_window_pattern", 6 if model_type == "gemma3_text" else 2))
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
            ]
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif model_type == "exaone4":  # layer_types, else sliding_window_pattern (where a window is set)
        layers = tuple(
            i for i, t in enumerate(_exaone4_layer_types(d, num_layers)) if t == "sliding_attention"
        )
    elif model_type == "olmo3":  # layer_types, else three sliding layers in four
        layer_types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)
        ]
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif model_type == "smollm3":  # where use_sliding_window: layer_types, else the layers without RoPE
        if not d.get("use_sliding_window", False):
            return None, ()
        layer_types = d.get("layer_types")
        if layer_types is None:
            nope = _nope_layers(d, num_layers)
            layer_types = ["sliding_attention" if i in nope else "full_attention" for i in range(num_layers)]
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            return None, ()
        layer_types = d.get("layer_types")
        if layer_types is not None:
            layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        else:
            first = int(d.get("max_window_layers", 28))
            layers = tuple(range(first, num_layers))
    else:  # mistral, mixtral, phi3: every layer
        layers = tuple(range(num_layers))
    if not layers:
        return None, ()
    if int(window) <= 0:
        raise UnsupportedModelError(f"sliding_window={window} must be positive")
    return int(window), layers


def _experts(d: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts (none for a dense model)."""
    if model_type == "mixtral":  # every layer sparse; intermediate_size is an expert's
        experts, size, norm = int(d.get("num_local_experts", 8)), int(d["intermediate_size"]), True
        layers = tuple(range(num_layers))
    elif model_type in ("qwen3_moe", "qwen2_moe"):  # transformers' defaults differ
        qwen2 = model_type == "qwen2_moe"
        experts = int(d.get("num_experts", 60 if qwen2 else 128))
        size = int(d.get("moe_intermediate_size", 1408 if qwen2 else 768))
        norm = bool(d.get("norm_topk_prob", False))
        step, dense = int(d.get("decoder_sparse_step", 1)), set(d.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    else:
        return {}
    per_token = {"mixtral": 2, "qwen2_moe": 4}.get(model_type, 8)
    fields = {
        "num_experts": experts,
        "experts_per_token": int(d.get("num_experts_per_tok", per_token)),
        "moe_intermediate_size": size,
        "norm_topk_prob": norm,
        "moe_layers": layers,
    }
    if model_type == "qwen2_moe":
        fields["shared_expert_size"] = int(d.get("shared_expert_intermediate_size", 5632))
    return fields


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
