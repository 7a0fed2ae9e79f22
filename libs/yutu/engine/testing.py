"""Test helpers: tiny random checkpoints and a minimal paged-cache driver for the model.

Checkpoints are written by default_model.write_checkpoint in the Hugging Face layout, so
transformers can load them as well. Only the image-text checkpoint (arch ``gemma3``: a vision tower
beside the language model) is built by transformers itself, imported when asked for (a test-only
dependency), so that its layout is the one transformers writes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from yutu.engine.attention import AttentionMetadata
from yutu.engine.default_model import write_checkpoint, write_tokenizer
from yutu.engine.demo_tokenizer import BOS, EOS, EOT, SPECIAL_TOKENS, TokenizerFiles, train_demo_tokenizer
from yutu.engine.model import LlamaForCausalLM

TINY_VOCAB = 512

_QWEN_EXPERTS: dict[str, Any] = {  # Qwen's mixtures of experts, tiny
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
_ARCH: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}),
    "qwen2": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True},
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        {
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "attention_bias": False,
        },
    ),
    "mistral": ("MistralForCausalLM", {"sliding_window": None, "tie_word_embeddings": False}),
    "phi3": (
        "Phi3ForCausalLM",
        {"sliding_window": None, "tie_word_embeddings": False, "rope_scaling": None, "pad_token_id": None},
    ),
    # layer 0 sliding, layer 1 full, each with its own RoPE base; a query scale of its own
    "gemma3_text": (
        "Gemma3ForCausalLM",
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_local_base_freq": 500.0,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "pad_token_id": None,
        },
    ),
    # Gemma (1) and CodeGemma: Llama's blocks with Gemma's GeGLU, norms and embedding scale
    "gemma": (
        "GemmaForCausalLM",
        {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True, "pad_token_id": None},
    ),
    # layer 0 sliding, layer 1 full; caps low enough that random weights' scores and logits bend
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 2.0,
            "pad_token_id": None,
        },
    ),
    # Granite 3's multipliers, none of them 1 (IBM's embedding and residual ones; a query scale and a
    # logit divisor that change the numbers here)
    "granite": (
        "GraniteForCausalLM",
        {
            "tie_word_embeddings": True,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.125,
            "logits_scaling": 4.0,
        },
    ),
    # SmolLM3's NoPE: layer 1 of 2 not rotated (every second here; every fourth in SmolLM3-3B)
    "smollm3": (
        "SmolLM3ForCausalLM",
        {
            "tie_word_embeddings": True,
            "no_rope_layers": [1, 0],
            "use_sliding_window": False,
            "pad_token_id": None,
        },
    ),
    # OLMo 2: norms on each block's output only, q/k norms across all heads
    "olmo2": ("Olmo2ForCausalLM", {"tie_word_embeddings": False, "pad_token_id": None, "rms_norm_eps": 1e-6}),
    # OLMo 3: OLMo 2 with layer 0 sliding (window 8) and layer 1 full; its checkpoints' RoPE base (in a
    # 4.x-shaped config transformers 5 gives the sliding layers this default whatever rope_theta says)
    "olmo3": (
        "Olmo3ForCausalLM",
        {
            "tie_word_embeddings": False,
            "pad_token_id": None,
            "rms_norm_eps": 1e-6,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 500000.0,
        },
    ),
    # EXAONE 4.0: OLMo 2's blocks, per-head q/k norms; layer 0 sliding (window 8), layer 1 global
    # without RoPE
    "exaone4": (
        "Exaone4ForCausalLM",
        {
            "tie_word_embeddings": False,
            "pad_token_id": None,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # four experts of width 32, two per token
    "qwen3_moe": ("Qwen3MoeForCausalLM", {**_QWEN_EXPERTS, "norm_topk_prob": True}),
    # the same, not renormalized, and a shared expert of width 48
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        {**_QWEN_EXPERTS, "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {
            "sliding_window": None,
            "tie_word_embeddings": False,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
        },
    ),  # fmt: skip
}


@lru_cache(maxsize=1)
def tiny_tokenizer() -> TokenizerFiles:
    """The demo byte-level BPE trained to 512 ids (Chinese and emoji split inside characters)."""
    return train_demo_tokenizer(TINY_VOCAB, seed=0)


def tiny_hf_config(arch: str = "llama", **config_overrides: Any) -> dict[str, Any]:
    """config.json of a tiny model: hidden 64, 2 layers, 4 query heads, 2 KV heads, vocab 512."""
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {', '.join(_ARCH)}, got {arch!r}")
    architecture, extra = _ARCH[arch]
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": arch,
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOT], ids[EOS]],
        "torch_dtype": "float32",
        **extra,
    }
    config.update(config_overrides)
    return config


def make_tiny_checkpoint(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    num_shards: int = 1,
    init_std: float = 0.1,
    **config_overrides: Any,
) -> Path:
    """A tiny random HF checkpoint directory loadable by our loader and by transformers.

    ``arch`` in ``_ARCH`` (llama, qwen2, qwen3, mistral, phi3, gemma3_text, gemma, gemma2, granite, smollm3,
    olmo2, olmo3, exaone4, qwen3_moe, qwen2_moe, mixtral), or ``gemma3`` or ``mistral3`` (image-text checkpoints:
    :func:`make_tiny_image_text_checkpoint`); ``config_overrides`` are config.json keys (e.g.
    ``num_key_value_heads=1``, ``tie_word_embeddings=True``, ``attention_bias=True``,
    ``rope_scaling={...}``, ``sliding_window=8``).
    """
    if arch in _IMAGE_TEXT:
        return make_tiny_image_text_checkpoint(
            Path(out_dir), seed, arch, init_std=init_std, **config_overrides
        )
    hf_config = tiny_hf_config(arch, **config_overrides)
    return write_checkpoint(
        Path(out_dir), hf_config, seed, tiny_tokenizer(), init_std=init_std, num_shards=num_shards
    )


# image-text architectures -> (their text model's arch in _ARCH, a one-layer vision tower's config)
_IMAGE_TEXT: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("gemma3_text", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "mistral3": ("mistral", {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "head_dim": 16, "image_size": 56, "patch_size": 14}),
}  # fmt: skip


def make_tiny_image_text_checkpoint(
    out_dir: Path, seed: int = 0, arch: str = "gemma3", *, init_std: float = 0.1, **text_overrides: Any
) -> Path:
    """A tiny random image-text checkpoint, built and saved by transformers: ``gemma3``, a
    ``Gemma3ForConditionalGeneration`` (Gemma 3 4B-27B's shape), or ``mistral3``, a
    ``Mistral3ForConditionalGeneration`` (Mistral Small 3.1 and 3.2's): the language model of
    ``tiny_hf_config`` of its text arch, a one-layer vision tower and its projector beside it; the
    token ids at the top level, as Google's configs have them. ``text_overrides``: keys of the text
    model's config."""
    import transformers  # a test dependency: see the module docstring

    text_arch, vision = _IMAGE_TEXT[arch]
    text = tiny_hf_config(text_arch, **text_overrides)
    top = {key: text[key] for key in ("bos_token_id", "eos_token_id")}
    for key in ("architectures", "model_type", "torch_dtype"):
        text.pop(key)
    model: torch.nn.Module
    if arch == "gemma3":
        gemma = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        model = transformers.Gemma3ForConditionalGeneration(gemma)
    else:  # the top level's tie said too: Mistral3Config's default ties, Mistral's text models do not
        tied = text.get("tie_word_embeddings", False)
        mistral = transformers.Mistral3Config(
            text_config=text, vision_config=vision, tie_word_embeddings=tied
        )
        model = transformers.Mistral3ForConditionalGeneration(mistral)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * init_std)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    path = out_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **top}, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(top, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out_dir, tiny_tokenizer())
    return out_dir


@dataclass
class _Seq:
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)


class PagedRunner:
    """Drives LlamaForCausalLM over a paged KV cache with no scheduler: for tests and references.

    Blocks are handed out from a shuffled free list, so block tables are non-contiguous.
    """

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, *, shuffle_seed: int | None = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        param = model.model.embed_tokens.weight
        self.device, self.dtype = param.device, param.dtype
        shape = model.config.kv_cache_shape(num_blocks, block_size)
        self.kv_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.free_blocks = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free_blocks)
        self.seqs: dict[int, _Seq] = {}

    def step(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """Append each (seq_id, new tokens) chunk in one forward; return (n_i, V) logits per chunk."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, new_tokens in chunks:
            seq = self.seqs.setdefault(seq_id, _Seq())
            start = len(seq.token_ids)
            seq.token_ids.extend(new_tokens)
            while len(seq.block_table) * self.block_size < len(seq.token_ids):
                seq.block_table.append(self.free_blocks.pop())
            for pos in range(start, len(seq.token_ids)):
                slots.append(
                    seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            input_ids.extend(new_tokens)
            positions.extend(range(start, len(seq.token_ids)))
            query_start.append(len(input_ids))
            context_lens.append(len(seq.token_ids))
            tables.append(list(seq.block_table))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            query_start=query_start,
            context_lens=context_lens,
            block_tables=tables,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids_t, pos_t, self.kv_cache, meta)  # (T, H)
            logits = self.model.compute_logits(hidden)  # (T, V)
        return [logits[query_start[i] : query_start[i + 1]] for i in range(len(chunks))]

    def free(self, seq_id: int) -> None:
        self.free_blocks.extend(self.seqs.pop(seq_id).block_table)


def prefill_decode_mixed_logits(model: LlamaForCausalLM, ids: Sequence[int]) -> torch.Tensor:
    """The logits of a prefill of ``ids``, one decode after it, then a batch of both kinds (a second
    sequence's prefill beside the first's next decode), concatenated: what tests compare between
    two ways of computing the same model."""
    runner = PagedRunner(model, 16, 4)
    (prefill,) = runner.step([(0, ids)])
    (decode,) = runner.step([(0, [7])])
    both = runner.step([(1, ids[:9]), (0, [11])])
    return torch.cat([prefill, decode, *both])


def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    prefill_chunk: int | None = None,
    shuffle_seed: int | None = 0,
) -> list[int]:
    """Argmax decoding through the paged cache (prefill in chunks of ``prefill_chunk``), no EOS stop."""
    total = len(prompt_ids) + max_new_tokens
    runner = PagedRunner(model, -(-total // block_size) + 1, block_size, shuffle_seed=shuffle_seed)
    chunk = prefill_chunk or len(prompt_ids)
    logits = torch.empty(0)
    for start in range(0, len(prompt_ids), chunk):
        (logits,) = runner.step([(0, prompt_ids[start : start + chunk])])
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(logits[-1].argmax()))
        if len(out) < max_new_tokens:
            (logits,) = runner.step([(0, out[-1:])])
    return out


THINK, END_THINK = 2, 3  # the tiny tokenizer's special tokens renamed <think> and </think>
# A chat template in Qwen3's manner: enable_thinking false closes the thinking in the prompt;
# open_thinking (this template's own) opens it there, as DeepSeek R1's templates do.
THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif open_thinking %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def rename_special_tokens(model_dir: Path, names: dict[int, str]) -> None:
    """Give the special tokens of ``model_dir``'s tokenizer.json new names, by id (a model family's
    markers on the tiny tokenizer: the weights do not care what a token is called)."""
    path = model_dir / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    for token_id, name in names.items():
        (added,) = [t for t in spec["added_tokens"] if t["id"] == token_id]
        if vocab.pop(added["content"]) != token_id:
            raise AssertionError(f"the tokenizer's token {token_id} is not {added['content']!r}")
        added["content"] = name
        vocab[name] = token_id
    path.write_text(json.dumps(spec), encoding="utf-8")


def make_thinking_checkpoint(out_dir: Path, special_markers: bool = True, **config_overrides: Any) -> Path:
    """A tiny Qwen3 checkpoint of a reasoning model's shape, with THINKING_TEMPLATE as its chat
    template; ``special_markers``: its special tokens THINK and END_THINK are renamed <think> and
    </think>, one token each as in Qwen3's vocabulary (else the markers are text of several tokens)."""
    model = make_tiny_checkpoint(out_dir, arch="qwen3", seed=0, **config_overrides)
    if special_markers:
        rename_special_tokens(model, {THINK: "<think>", END_THINK: "</think>"})
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = THINKING_TEMPLATE
    config.pop("added_tokens_decoder", None)  # tokenizer.json's names hold
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return model
