"""Our Llama-family model over the paged cache against transformers, float32 on CPU.

Every case compares logits with transformers' own implementation of the same checkpoint: full
prefill, chunked prefill, token-by-token decode through shuffled (non-contiguous) block tables, and
mixed batches of prefill chunks and decode steps; then greedy generation token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from yutu.engine import native
from yutu.engine.attention import AttentionMetadata, build_attention_plan, paged_attention, write_kv_cache
from yutu.engine.loader import load_model, native_bf16
from yutu.engine.model import (
    Linear,
    LlamaForCausalLM,
    RMSNorm,
    SparseMoE,
    fuse_projections,
    pack_cpu_linears,
)
from yutu.engine.testing import (
    PagedRunner,
    greedy_generate,
    make_tiny_checkpoint,
    prefill_decode_mixed_logits,
)

transformers = pytest.importorskip("transformers")

TOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so the scaling bends frequencies we use
}

LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.5, 6.0],  # head_dim 16: one per frequency
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 96.0],  # past 256 positions: not served
}
PARTIAL_LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.4, 2.5, 5.0],
    "long_factor": [1.0, 4.0, 16.0, 64.0],
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied-bias": (
        "llama",
        {"num_key_value_heads": 4, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "llama3-rope-mqa": (
        "llama",
        {"num_key_value_heads": 1, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # transformers 5 layout: rope settings only under rope_parameters.
    "llama3-rope-parameters": (
        "llama",
        {"rope_theta": None, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 50000.0}},
    ),
    "qwen2-tied": ("qwen2", {}),
    "qwen2-untied-gqa": ("qwen2", {"tie_word_embeddings": False, "num_attention_heads": 8, "head_dim": 8}),
    "qwen3-tied": ("qwen3", {}),
    # YaRN as Qwen3's long-context configs set it (a pretraining length of 64 here, so the ramp
    # between kept and divided frequencies falls among a 16-wide head's dims)
    "qwen3-yarn": (
        "qwen3",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    # YaRN's other knobs: betas, an attention factor from mscale / mscale_all_dim, no truncation
    "llama-yarn-mscale": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            }
        },
    ),  # fmt: skip
    # biases on q/k/v and o, a head wider than hidden / heads, one KV head
    "qwen3-untied-bias-mqa": (
        "qwen3",
        {"tie_word_embeddings": False, "attention_bias": True, "head_dim": 32, "num_key_value_heads": 1},
    ),
    "qwen3-sliding-layer1": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "mistral-sliding": ("mistral", {"sliding_window": 8}),
    "gemma3": ("gemma3_text", {}),  # layer 0 sliding (window 8, RoPE base 500), layer 1 full
    # transformers 5's layout (rope_parameters per layer type), a linear-scaled global RoPE, MQA
    "gemma3-rope-parameters-mqa": (
        "gemma3_text",
        {
            "rope_theta": None,
            "rope_local_base_freq": None,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 700.0},
            },
        },
    ),  # fmt: skip
    # Gemma 3 4B-27B's image-text checkpoint, saved by transformers: the language model under
    # language_model., a vision tower and projector beside it (not loaded), defaults under text_config
    "gemma3-image-text": ("gemma3", {}),
    # Mistral Small 3.1 / 3.2's image-text checkpoint, saved by transformers: Mistral's language model
    # under language_model., a Pixtral vision tower and projector beside it (not loaded); a window too
    "mistral3-image-text-sliding": ("mistral3", {"sliding_window": 8}),
    # Gemma (1): Llama's blocks, Gemma's norms (1 + weight), GeGLU and embedding scale; MQA as the 2B
    "gemma-mqa": ("gemma", {"num_key_value_heads": 1}),
    # Gemma 2: soft-capped scores (0.5 here) and logits (2.0), layer 0 sliding (window 8), one RoPE
    "gemma2": ("gemma2", {}),
    # Google's 27B shape: the query scale of hidden / heads, MQA, no cap on the scores
    "gemma2-no-attention-cap-mqa": (
        "gemma2",
        {"attn_logit_softcapping": None, "num_key_value_heads": 1, "query_pre_attn_scalar": 16},
    ),  # fmt: skip
    # Granite 3: four multipliers (embedding, residual, attention scores, logits)
    "granite": ("granite", {}),
    # SmolLM3: layer 1 without RoPE (NoPE), layer 0 rotated
    "smollm3-nope": ("smollm3", {}),
    # OLMo 2: the blocks' outputs normalized, their inputs not; q/k norms across all heads; MHA too
    "olmo2": ("olmo2", {}),
    "olmo2-mha": ("olmo2", {"num_key_value_heads": 4}),
    # OLMo 3: a sliding layer and a full one; YaRN on the full one only (transformers 4.x's config)
    "olmo3-yarn": (
        "olmo3",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    # EXAONE 4.0: OLMo 2's blocks, per-head q/k norms, a sliding layer and a global one without RoPE
    "exaone4": ("exaone4", {}),
    # without a window: every layer global, every layer rotated
    "exaone4-global": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 2}),
    "phi3-gqa": ("phi3", {}),  # q/k/v and gate/up stored fused in the checkpoint
    "phi3-sliding-mha": ("phi3", {"sliding_window": 8, "num_key_value_heads": 4}),
    # Phi-3.5's LongRoPE within its pretraining length: frequencies divided by short_factor, cos and
    # sin scaled by sqrt(1 + ln 2 / ln 256)
    "phi3-longrope": (
        "phi3",
        {"max_position_embeddings": 512, "original_max_position_embeddings": 256, "rope_scaling": LONGROPE},
    ),
    # Phi-4-mini's shape: RoPE on the first half of each head (the rest passes), LongRoPE over it
    "phi3-partial-longrope": (
        "phi3",
        {
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 512,
            "original_max_position_embeddings": 256,
            "rope_scaling": PARTIAL_LONGROPE,
        },
    ),  # fmt: skip
    # LongRoPE's long factors: an engine asked for more than the pretraining length (8 here: every
    # sequence of these tests is longer, so transformers rotates each by its long factors too)
    "phi3-longrope-long": (
        "phi3",
        {
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 512,
            "original_max_position_embeddings": 8,
            "rope_scaling": PARTIAL_LONGROPE,
        },
    ),  # fmt: skip
    "qwen3-moe": ("qwen3_moe", {}),
    # Qwen2-MoE: Qwen2's attention (q/k/v biases), the experts, a shared expert behind a sigmoid gate
    "qwen2-moe-shared": ("qwen2_moe", {}),
    # layer 0 dense, the top weights renormalized
    "qwen2-moe-mixed-renorm": ("qwen2_moe", {"mlp_only_layers": [0], "norm_topk_prob": True}),
    # layer 0 dense (mlp_only_layers), top-k weights not renormalized, one expert per token
    "qwen3-moe-mixed-top1": (
        "qwen3_moe",
        {"mlp_only_layers": [0], "norm_topk_prob": False, "num_experts_per_tok": 1, "num_experts": 8},
    ),
    "mixtral-sliding": ("mixtral", {"sliding_window": 8}),
    # Only layers >= max_window_layers slide: the forward mixes full and windowed layers.
    "qwen2-sliding-layer1": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=list(CASES))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LlamaForCausalLM, Any]:
    """(our model, transformers' model) loaded from the same tiny checkpoint."""
    arch, overrides = CASES[request.param]
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=7, **overrides)
    for key in ("rope_theta", "rope_local_base_freq"):
        if (
            key in overrides and overrides[key] is None
        ):  # drop the key altogether, as transformers 5 writes it
            _drop_key(model_dir, key)
    long = request.param.endswith("-long")  # an engine of max_model_len 512: the long factors
    ours, config = load_model(model_dir, torch.device("cpu"), torch.float32, 512 if long else None)
    assert config.longrope_regime == ("long" if long else config.longrope_regime)
    auto = (
        transformers.AutoModelForImageTextToText if arch == "mistral3" else transformers.AutoModelForCausalLM
    )
    hf = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, hf


def _drop_key(model_dir: Path, key: str) -> None:
    import json

    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop(key)
    path.write_text(json.dumps(config))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (T, V)


@pytest.mark.parametrize("block_size", [4, 16])
def test_full_prefill_matches_transformers(pair: tuple[LlamaForCausalLM, Any], block_size: int) -> None:
    ours, hf = pair
    ids = _prompt(45, seed=1)
    (logits,) = PagedRunner(ours, 32, block_size).step([(0, ids)])
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_matches_transformers(pair: tuple[LlamaForCausalLM, Any], block_size: int) -> None:
    ours, hf = pair
    ids = _prompt(45, seed=2)
    runner = PagedRunner(ours, 32, block_size, shuffle_seed=3)
    # Chunks end mid-block, so later chunks append into a partly filled block.
    pieces = [runner.step([(0, ids[a:b])])[0] for a, b in ((0, 13), (13, 30), (30, 45))]
    torch.testing.assert_close(torch.cat(pieces), _hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_steps_match_transformers(pair: tuple[LlamaForCausalLM, Any], block_size: int) -> None:
    ours, hf = pair
    ids = _prompt(40, seed=4)
    runner = PagedRunner(ours, 32, block_size, shuffle_seed=5)
    pieces = [runner.step([(0, ids[:10])])[0]]
    pieces += [runner.step([(0, [tok])])[0] for tok in ids[10:]]
    assert runner.seqs[0].block_table != sorted(runner.seqs[0].block_table)  # really non-contiguous
    torch.testing.assert_close(torch.cat(pieces), _hf_logits(hf, ids), atol=TOL, rtol=0)


def test_mixed_batches_match_transformers(pair: tuple[LlamaForCausalLM, Any]) -> None:
    """Prefill chunks and decode steps of several sequences share one forward pass."""
    ours, hf = pair
    prompts = {
        0: _prompt(37, seed=10),
        1: _prompt(25, seed=11),
        2: _prompt(12, seed=12),
        3: _prompt(30, seed=13),
    }
    runner = PagedRunner(ours, 64, 4, shuffle_seed=6)
    fed = {i: 0 for i in prompts}
    got: dict[int, list[torch.Tensor]] = {i: [] for i in prompts}
    # Per step: how many tokens each sequence feeds (1 = a decode-shaped step).
    schedule = [
        {0: 20, 1: 5},
        {0: 1, 1: 18, 2: 9},
        {0: 1, 2: 1, 3: 12},
        {0: 1, 1: 1, 2: 1, 3: 1},
        {0: 14, 1: 1, 2: 1, 3: 17},
    ]
    for step in schedule:
        batch = [(i, prompts[i][fed[i] : fed[i] + n]) for i, n in step.items()]
        for (i, chunk), logits in zip(batch, runner.step(batch), strict=True):
            fed[i] += len(chunk)
            got[i].append(logits)
    for i, ids in prompts.items():
        assert fed[i] == len(ids)
        torch.testing.assert_close(torch.cat(got[i]), _hf_logits(hf, ids), atol=TOL, rtol=0)


def test_greedy_generation_matches_transformers(pair: tuple[LlamaForCausalLM, Any]) -> None:
    ours, hf = pair
    prompt = _prompt(21, seed=20)
    hf.generation_config.eos_token_id = None  # generate all 32 tokens on both sides
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(prompt) :].tolist()
    assert len(ref) == 32
    assert greedy_generate(ours, prompt, 32, block_size=4, prefill_chunk=8) == ref
    assert greedy_generate(ours, prompt, 32, block_size=16) == ref


def test_bfloat16_runs_and_tracks_float32(tmp_path: Path) -> None:
    """Same code in bfloat16 (the CUDA dtype): close to float32, same greedy start."""
    model_dir = make_tiny_checkpoint(tmp_path, "llama", seed=3)
    ids = _prompt(30, seed=21)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(model_dir, torch.device("cpu"), dtype)
        runner = PagedRunner(model, 16, 4)
        (prefill,) = runner.step([(0, ids)])
        (decode,) = runner.step([(0, [7])])
        out[dtype] = torch.cat([prefill, decode])
        assert out[dtype].dtype == torch.float32  # logits always float32
    assert (out[torch.bfloat16] - out[torch.float32]).abs().max() < 0.1


@pytest.mark.skipif(
    not native_bf16(), reason="packed only on CPUs with bfloat16 arithmetic (as the engine does)"
)
@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "attention_bias": True}])
def test_packed_bfloat16_linears_compute_what_the_plain_ones_do(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    """pack_cpu_linears (the CPU bfloat16 fast path) against the plain F.linear reference: the same
    logits for a prefill, a decode and a batch of both; the plain weights are released; a tied LM
    head gets its own packed copy and the embedding keeps its weight."""
    model_dir = make_tiny_checkpoint(tmp_path, "llama", seed=4, **overrides)
    ids = _prompt(30, seed=22)
    out = {}
    for packed in (False, True):
        model, _ = load_model(model_dir, torch.device("cpu"), torch.bfloat16)
        if packed:
            assert pack_cpu_linears(model) == 2 * 7 + 1  # seven per layer (q k v o gate up down), the LM head
            assert pack_cpu_linears(model) == 0  # once only
            assert all(
                m.weight.is_meta and m.packed is not None for m in model.modules() if isinstance(m, Linear)
            )
            assert not model.model.embed_tokens.weight.is_meta
        out[packed] = prefill_decode_mixed_logits(model, ids)
    assert torch.allclose(out[True], out[False], atol=1e-3, rtol=0), (out[True] - out[False]).abs().max()


@pytest.mark.parametrize(
    ("dtype", "overrides", "atol"),
    [
        (torch.float32, {}, 1e-5),
        (torch.float32, {"attention_bias": True, "mlp_bias": True}, 1e-5),  # Qwen2-style biases
        (torch.bfloat16, {"tie_word_embeddings": True}, 1e-3),  # packed for oneDNN afterwards
        (torch.float32, {"arch": "qwen3"}, 1e-5),  # q/k norms between the product and the rotation
        (torch.bfloat16, {"arch": "qwen3", "attention_bias": True}, 1e-3),
        (torch.float32, {"arch": "mixtral"}, 1e-5),  # every expert's gate and up fused
        (torch.float32, {"arch": "phi3"}, 1e-5),  # fused again from the checkpoint's fused tensors
        (torch.float32, {"arch": "phi3", "partial_rotary_factor": 0.5}, 1e-5),  # half of each head rotated
        (torch.float32, {"arch": "gemma3_text"}, 1e-5),  # gate and up fused under a gelu
    ],
)
def test_fused_projections_compute_what_the_separate_ones_do(
    tmp_path: Path, dtype: torch.dtype, overrides: dict[str, Any], atol: float
) -> None:
    """fuse_projections (q/k/v in one product, gate/up in another) against Hugging Face's separate
    projections, the reference: the same logits for a prefill, a decode and a batch of both."""
    overrides = dict(overrides)
    model_dir = make_tiny_checkpoint(tmp_path, overrides.pop("arch", "llama"), seed=5, **overrides)
    ids = _prompt(30, seed=23)
    out = {}
    for fused in (False, True):
        model, config = load_model(model_dir, torch.device("cpu"), dtype)
        if fused:
            assert fuse_projections(model) == config.num_layers
            assert fuse_projections(model) == 0  # once only
            attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
            if isinstance(mlp, SparseMoE):
                mlp = mlp.experts[-1]  # each expert's fused
            assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
            assert all(
                m.weight.is_meta for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
            )
            if dtype == torch.bfloat16 and native_bf16():  # as the engine packs
                assert pack_cpu_linears(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the LM head
        out[fused] = prefill_decode_mixed_logits(model, ids)
    assert torch.allclose(out[True], out[False], atol=atol, rtol=0), (out[True] - out[False]).abs().max()


def test_packing_refuses_what_it_does_not_speed_up(tmp_path: Path) -> None:
    model, _ = load_model(make_tiny_checkpoint(tmp_path), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="only CPU bfloat16 weights are packed"):
        pack_cpu_linears(model)


@pytest.mark.parametrize("rows", [1, 16, 513])
def test_float32_rms_norm_fast_path_equals_the_reference(rows: int) -> None:
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(rows, 96) * 3
    assert torch.allclose(norm(x), norm.reference(x), atol=1e-6, rtol=1e-6)
    x16 = x.to(torch.bfloat16)  # other dtypes run the reference itself
    assert torch.equal(norm.to(torch.bfloat16)(x16), norm.reference(x16))


def test_rejects_mismatched_cache_and_metadata(tmp_path: Path) -> None:
    model, config = load_model(make_tiny_checkpoint(tmp_path), torch.device("cpu"), torch.float32)
    ids = torch.tensor([5, 6, 7])
    meta = AttentionMetadata(torch.tensor([0, 1, 2]), [0, 3], [3], [[0]])
    bad_cache = torch.zeros(4, config.num_layers, 2, 4, config.num_kv_heads + 1, config.head_dim)
    with pytest.raises(ValueError, match="kv_cache has shape"):
        model(ids, torch.arange(3), bad_cache, meta)
    cache = torch.zeros(config.kv_cache_shape(4, 4))
    with pytest.raises(ValueError, match="dtype"):
        model(ids, torch.arange(3), cache.to(torch.bfloat16), meta)
    short = AttentionMetadata(torch.tensor([0, 1, 2]), [0, 3], [2], [[0]])  # context < chunk
    with pytest.raises(ValueError, match="chunk of 3 tokens, context 2"):
        model(ids, torch.arange(3), cache, short)
    no_blocks = AttentionMetadata(torch.tensor([0, 1, 2]), [0, 3], [3], [[]])
    with pytest.raises(ValueError, match="need 0 < chunk <= context and >= 1 blocks"):
        model(ids, torch.arange(3), cache, no_blocks)


def _reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """Dense attention of q (n, nh, hd) at positions q_pos over keys 0..ctx-1, k/v (ctx, kvh, hd)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (ctx, nh, hd)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (nh, n, ctx)
    k_pos = torch.arange(k.shape[0])[None, :]  # (1, ctx)
    allowed = k_pos <= q_pos[:, None]  # (n, ctx)
    if window is not None:
        allowed &= k_pos > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # (n, nh, hd)


@pytest.mark.parametrize("window", [None, 5, 16, 64])
@pytest.mark.parametrize("group_tokens", [None, 1, 40])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense_reference(
    window: int | None, group_tokens: int | None, block_size: int
) -> None:
    """Mixed chunks and decode steps over shuffled blocks; decode groups of every size; on torch's
    operations and on the native kernels (which take the prefill chunks a window does not cut: all
    of them with no window or one of 64, those of up to 16 keys with 16)."""
    gen = torch.Generator().manual_seed(0)
    nh, kvh, hd, num_blocks = 6, 2, 8, 64
    chunks_and_contexts = [(1, 37), (5, 5), (1, 3), (12, 30), (1, 17), (1, 1), (3, 50)]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.zeros(num_blocks, block_size, kvh, hd)
    v_cache = torch.zeros(num_blocks, block_size, kvh, hd)
    q_parts, slots, query_start, tables, expected = [], [], [0], [], []
    for chunk, ctx in chunks_and_contexts:
        table = [order.pop() for _ in range(-(-ctx // block_size))]
        k = torch.randn(ctx, kvh, hd, generator=gen)
        v = torch.randn(ctx, kvh, hd, generator=gen)
        all_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv_cache(k, v, k_cache, v_cache, all_slots)  # the cached prefix and this chunk
        q = torch.randn(chunk, nh, hd, generator=gen)
        q_parts.append(q)
        slots.append(all_slots[ctx - chunk :])
        query_start.append(query_start[-1] + chunk)
        tables.append(table)
        expected.append(_reference_attention(q, k, v, torch.arange(ctx - chunk, ctx), window, 0.3))
    meta = AttentionMetadata(torch.cat(slots), query_start, [c for _, c in chunks_and_contexts], tables)
    plan = build_attention_plan(meta, block_size, torch.device("cpu"), window, group_tokens)
    if group_tokens == 1:
        assert len(plan.decode) == 4  # one decode sequence per group
    if group_tokens is None:
        assert len(plan.decode) == 1
    if window == 5:  # blocks wholly before the window are not read: 5 keys span at most 3 blocks
        assert max(g.block_table.shape[1] for g in plan.decode) <= 3
        assert max(span.block_ids.numel() for span in plan.prefill) <= -(-(12 + 4) // block_size) + 1
    out = paged_attention(torch.cat(q_parts), k_cache, v_cache, meta, 0.3, plan=plan)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=0)
    # Without a plan, paged_attention builds the same one itself.
    torch.testing.assert_close(
        paged_attention(torch.cat(q_parts), k_cache, v_cache, meta, 0.3, sliding_window=window), out
    )
    ops = native.load()
    native_out = paged_attention(torch.cat(q_parts), k_cache, v_cache, meta, 0.3, plan=plan, ops=ops)
    torch.testing.assert_close(native_out, torch.cat(expected), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_experts_fast_paths_equal_the_general_path(tmp_path: Path, arch: str) -> None:
    """SparseMoE's fast paths -- one token (a decode step of one sequence) and many grouped by
    expert (batches, prompts) -- against its reference, bit for bit, on torch's operations and with
    fused projections and the native kernels."""
    model, _ = load_model(make_tiny_checkpoint(tmp_path, arch, seed=9), torch.device("cpu"), torch.float32)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    gen = torch.Generator().manual_seed(4)
    sizes = [1] * 10 + [2, 3, 16, 64, 257, 1024]
    for tokens in sizes:
        x = torch.randn(tokens, model.config.hidden_size, generator=gen)
        assert torch.equal(moe(x), moe.reference(x)), tokens
    fuse_projections(model)
    for ops in (None, native.load()):  # the native kernels as the engine runs them on CPU
        for tokens in (1, 16, 257):
            x = torch.randn(tokens, model.config.hidden_size, generator=gen)
            assert torch.equal(moe(x, ops), moe.reference(x, ops)), tokens
    # Tokens that all choose the same experts (the others' runs empty).
    x = torch.randn(1, model.config.hidden_size, generator=gen).expand(8, -1).contiguous()
    assert torch.equal(moe(x), moe.reference(x))
