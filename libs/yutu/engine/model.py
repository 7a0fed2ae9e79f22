"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3, Gemma 1-3, Granite, SmolLM3,
OLMo 2 and 3, EXAONE 4; Qwen3-MoE, Qwen2-MoE, Mixtral) over a paged KV cache.

Read top to bottom: RMSNorm, rotary embedding, attention, SwiGLU MLP, decoder layer, model. The
batch is flat: ``T`` tokens of several sequences laid end to end (see AttentionMetadata), so no
padding is ever computed outside attention. Module and parameter names mirror Hugging Face's, so a
checkpoint's tensor names are this module's ``state_dict`` keys.

Notation in shape comments: T tokens in the batch, H hidden size, nh query heads, kvh key/value
heads, hd head dim, I intermediate size, V vocab size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from yutu.engine.attention import (
    AttentionMetadata,
    AttentionPlan,
    build_attention_plan,
    paged_attention,
    write_kv_cache,
)
from yutu.engine.model_config import ModelConfig

CPU_DECODE_GROUP_BYTES = 1 << 20  # see LlamaForCausalLM._decode_group_tokens


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be prepacked for oneDNN on CPU (see :func:`pack_cpu_linears`).

    Unpacked, the product is the plain ``F.linear`` (the reference); packed, it runs on oneDNN's
    blocked copy of the weight.
    """

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


PACK_BATCH_HINT = 16  # rows oneDNN lays the packed weights out for (any row count still runs)


def pack_cpu_linears(model: nn.Module) -> int:
    """Prepack every :class:`Linear` of ``model`` (on CPU, bfloat16) for oneDNN; returns how many.

    PyTorch's bfloat16 GEMM on a CPU without AMX spends ~15-20 us per call before any arithmetic
    (a 256x256 weight at one row: 21 us in bfloat16 against 6 us in float32), which made a batch-1
    decode step of the demo model slower in bfloat16 than in float32; oneDNN's prepacked weights
    skip that (loadtests/bench_engine.py prints the effect). The plain weight is released: the
    packed copy replaces it (the parameter keeps its shape on the meta device), so memory stays
    one copy of the weights; a tied LM head gets its own packed copy, the embedding keeps the
    plain one.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None and not module.weight.is_meta:
            weight = module.weight.detach()  # (meta: a projection folded into a fused one)
            if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
                raise ValueError(
                    f"only CPU bfloat16 weights are packed, got {weight.dtype} on {weight.device}"
                )
            module.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
            count += 1
    return count


def _fused(parts: list[Linear]) -> Linear:
    """One Linear computing ``parts`` side by side (their outputs concatenated, in order); the parts'
    weights are released (their parameters keep their shapes on the meta device)."""
    weight = torch.cat([p.weight.detach() for p in parts])  # (sum of out, in)
    bias = (
        None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts if p.bias is not None])
    )
    with torch.device("meta"):
        fused = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    for p in parts:
        p.weight = nn.Parameter(torch.empty_like(p.weight, device="meta"), requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(torch.empty_like(p.bias, device="meta"), requires_grad=False)
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fold each attention's q/k/v projections into one ``qkv_proj`` and each MLP's gate/up into one
    ``gate_up_proj`` (as vLLM's QKVParallelLinear and MergedColumnParallelLinear); returns how
    many layers changed. Call it after loading the checkpoint (whose tensors keep Hugging Face's
    names) and before :func:`pack_cpu_linears`.

    Fewer, wider products and one rotary call for q and k together: the demo model's batch-1
    decode step goes from 29 products to 17 and from 349 tensor operations to 317; in bfloat16 on a
    2-core CPU, 1.03-1.12x the tokens/s at batch 1, batch 16 and prefill unchanged within the noise
    (``loadtests/bench_engine.py`` prints this A/B; three runs). The separate projections stay the
    reference path; a test holds the two to the same logits.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.qkv_proj is None:
            module.qkv_proj = _fused([module.q_proj, module.k_proj, module.v_proj])
            count += 1
        elif isinstance(module, MLP) and module.gate_up_proj is None:
            module.gate_up_proj = _fused([module.gate_proj, module.up_proj])
    return count


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like the reference implementation; with an
    ``offset`` (Gemma's 1), x / rms(x) * (offset + weight), rounded to x's dtype after the product
    as Gemma's own norm does."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, weight_float32: bool = False) -> None:
        """``weight_float32``: the weight multiplied in float32 before rounding (OLMo 2's), as with an offset."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.weight_float32 = weight_float32 or bool(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not self.offset:  # one
            return F.rms_norm(
                x, self.weight.shape, self.weight, self.eps
            )  # kernel, tested against the reference
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()  # (T, H)
        var = x32.pow(2).mean(-1, keepdim=True)  # (T, 1)
        x32 = x32 * torch.rsqrt(var + self.eps)  # (T, H)
        if self.weight_float32:
            return (x32 * (self.offset + self.weight.float())).to(dtype)  # (T, H)
        return self.weight * x32.to(dtype)  # (T, H)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (rd/2,) float32 on CPU, with the config's RoPE scaling applied (rd: the
    rotated dims of a head, ``config.rope_dim``)."""
    dim = config.rope_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # (hd/2,)
    inv_freq = 1.0 / (config.rope_theta**exponents)  # (hd/2,)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "longrope":  # the engine's regime (ModelConfig.for_context)
        factors = scaling["long_factor"] if scaling.get("long") else scaling["short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config.rope_theta, dim, scaling)
    assert scaling["rope_type"] == "llama3", scaling  # ModelConfig admits nothing else
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq  # (hd/2,)
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # (hd/2,)
    smooth = (old_len / wavelen - low) / (high - low)  # (hd/2,)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # (hd/2,)
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # (hd/2,)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies (dim/2,) (see yutu.engine.model_config._yarn): each dim's original
    frequency where it turns more than beta_fast times in the pretraining length, divided by the
    factor where it turns fewer than beta_slow times, linearly blended in between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_turning(turns: float) -> float:  # the dim whose wavelength fits `turns` times in `original`
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_turning(scaling["beta_fast"]), dim_turning(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)  # (rd/2,)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # (rd/2,): 1 where the original frequency stays (extrapolated), 0 where divided
    return (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept  # (rd/2,)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the batch's positions, computed on the fly (no max-length table)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Kept out of the state dict and out of `.to(dtype)`: frequencies stay float32.
        self._inv_freq_cpu = rope_inv_freq(config)  # (hd/2,)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        scaling = config.rope_scaling or {}
        self._scale = float(scaling.get("attention_factor", 1.0))  # LongRoPE scales cos and sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = self._inv_freq_cpu.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, rd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, rd)
        if self._scale != 1.0:
            return (emb.cos() * self._scale).to(dtype), (emb.sin() * self._scale).to(dtype)  # (T, rd)
        return emb.cos().to(dtype), emb.sin().to(dtype)  # (T, rd), (T, rd)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (T, heads, hd) by the (T, rd) tables, half-split layout (Hugging Face convention);
    tables narrower than a head (rd < hd: partial rotation) rotate its first rd dims, the rest pass."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)  # (T, heads, hd)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (T, heads, hd)
    return x * cos[:, None, :] + rotated * sin[:, None, :]  # (T, heads, hd)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.softcap = config.attn_logit_softcap  # Gemma 2: cap * tanh(score / cap); None: none
        h, qd, kvd = (
            config.hidden_size,
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        self.q_proj = Linear(h, qd, bias=config.attention_bias)
        self.k_proj = Linear(h, kvd, bias=config.attention_bias)
        self.v_proj = Linear(h, kvd, bias=config.attention_bias)
        self.o_proj = Linear(qd, h, bias=config.o_proj_bias)
        self.qkv_proj: Linear | None = None  # q, k and v in one product, once fuse_projections ran
        # Qwen3, Gemma 3: every query and key head RMS-normalized (weights of one head's width) before RoPE
        # OLMo 2: across all heads at once (weights of nh*hd and kvh*hd)
        eps, offset, f32 = config.rms_norm_eps, config.norm_offset, config.norm_weight_float32
        self.qk_norm_whole = config.qk_norm_whole
        q_width, k_width = (qd, kvd) if config.qk_norm_whole else (config.head_dim, config.head_dim)
        self.q_norm = RMSNorm(q_width, eps, offset, f32) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, eps, offset, f32) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: AttentionPlan,
        layer: int = 0,
        ops: ModuleType | None = None,
    ) -> torch.Tensor:
        """``ops``: the native kernels (see LlamaForCausalLM.ops), or None for torch's operations."""
        n_tok, nh, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is None:  # the reference: Hugging Face's three projections
            q = self.q_proj(x).view(n_tok, nh, hd)  # (T, nh, hd)
            k = self.k_proj(x).view(n_tok, kvh, hd)  # (T, kvh, hd)
            v = self.v_proj(x).view(n_tok, kvh, hd)  # (T, kvh, hd)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # (T, nh, hd), (T, kvh, hd)
        else:
            qkv = self.qkv_proj(x).view(n_tok, nh + 2 * kvh, hd)  # heads: [ q (nh) | k (kvh) | v (kvh) ]
            if self.q_norm is not None and self.k_norm is not None:  # in place: qkv is this call's own
                qkv[:, :nh] = self._norm(self.q_norm, qkv[:, :nh])
                qkv[:, nh : nh + kvh] = self._norm(self.k_norm, qkv[:, nh : nh + kvh])
            if ops is None:
                qk = apply_rotary(qkv[:, : nh + kvh], cos, sin)  # (T, nh + kvh, hd): q and k rotated at once
            else:
                qk = qkv[:, : nh + kvh]
                ops.rotary_(qk[..., : cos.shape[-1]], cos, sin)  # in place (qkv is this call's own); rd of hd
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + kvh :]  # views
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, plan, ops)
        if meta.dense is not None:
            meta.dense.fill(layer, k_cache, v_cache)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, plan=plan, ops=ops, softcap=self.softcap)
        # (T, nh, hd); the dense decode cache's rows are left unset there: attended below
        if meta.dense is not None:
            meta.dense.attend(layer, q, o, self.scale, plan.sliding_window, self.softcap)
        return self.o_proj(o.reshape(n_tok, nh * hd))  # (T, H)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """A q or k norm of (T, heads, hd): per head, or across all heads (``qk_norm_whole``)."""
        if self.qk_norm_whole:
            return norm(x.reshape(x.shape[0], -1)).view(x.shape)  # (T, heads, hd)
        return norm(x)  # (T, heads, hd)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)) -- SwiGLU (silu), or GeGLU (Gemma's tanh-approximated
    gelu); a dense layer's, or one expert's."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        h, i = hidden_size, intermediate_size
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self.gate_up_proj: Linear | None = None  # gate and up in one product, once fuse_projections ran
        self.act = act
        self.act_fn = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, ops: ModuleType | None = None) -> torch.Tensor:
        if self.gate_up_proj is None:  # the reference
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # (T, I) -> (T, H)
        gate_up = self.gate_up_proj(x)  # (T, 2I): [ gate | up ]
        if ops is not None and self.act == "silu":
            return self.down_proj(ops.silu_mul(gate_up))  # (T, I) -> (T, H)
        i = gate_up.shape[1] // 2
        return self.down_proj(self.act_fn(gate_up[:, :i]) * gate_up[:, i:])  # (T, I) -> (T, H)


class SparseMoE(nn.Module):
    """A sparse mixture of SwiGLU experts (Qwen3-MoE, Qwen2-MoE, Mixtral): the router's softmax over
    the experts picks each token's top ``experts_per_token``, whose outputs are summed weighted by
    those probabilities (renormalized over the chosen where ``norm_topk_prob``) -- transformers'
    computation, expert by expert in increasing order, each over the tokens that chose it; then,
    for Qwen2-MoE, the shared expert's output added, weighted by its gate's sigmoid."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        self.top_k = config.experts_per_token
        self.renormalize = config.norm_topk_prob
        # Qwen2-MoE: every token through a shared expert too, weighted by sigmoid(shared_expert_gate(x))
        size = config.shared_expert_size
        self.shared_expert = MLP(config.hidden_size, size) if size else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if size else None

    def forward(self, x: torch.Tensor, ops: ModuleType | None = None) -> torch.Tensor:
        weights, chosen = self._route(x)
        if x.shape[0] == 1:
            return self._shared(x, ops, self._one_token(x, ops, weights, chosen))
        return self._shared(x, ops, self._grouped(x, ops, weights, chosen))

    def _shared(self, x: torch.Tensor, ops: ModuleType | None, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum ``out``, plus the shared expert's gated output where there is one."""
        if self.shared_expert is None or self.shared_expert_gate is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)  # (T, H)

    def _one_token(
        self, x: torch.Tensor, ops: ModuleType | None, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """One token (a decode step of one sequence): its k experts straight, without finding each
        expert's tokens; the same sums in the same order as the reference (a test holds them equal)."""
        out = torch.zeros_like(x)  # (1, H)
        for slot, expert in sorted(enumerate(chosen[0].tolist()), key=lambda pair: pair[1]):
            out += self.experts[expert](x, ops) * weights[0, slot]
        return out

    def _grouped(
        self, x: torch.Tensor, ops: ModuleType | None, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """Many tokens: the (token, expert) pairs sorted by expert once -- each expert's tokens one
        contiguous run, in increasing token order as the reference finds them -- then each expert
        over its run and one scatter of every row, in that order: the reference's products and sums
        without a search and two gathers per expert (a test holds the two equal bit for bit)."""
        pairs = chosen.reshape(-1)  # (T*k,) token-major
        order = torch.argsort(pairs, stable=True)  # the pairs by expert, then by token
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        tokens = order // chosen.shape[1]  # (T*k,) each sorted pair's token
        runs = x[tokens].split(counts)  # each expert's tokens
        rows = torch.cat([self.experts[e](run, ops) for e, run in enumerate(runs) if counts[e]])  # (T*k, H)
        rows *= weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, rows)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts (T, k) and their weights (T, k) in x's dtype."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # (T, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, k), (T, k)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def reference(
        self,
        x: torch.Tensor,
        ops: ModuleType | None = None,
        weights: torch.Tensor | None = None,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every chosen expert in increasing order, over the tokens that chose it (any T)."""
        if weights is None or chosen is None:
            weights, chosen = self._route(x)
        out = torch.zeros_like(x)  # (T, H)
        for expert in chosen.unique().tolist():  # sorted
            tokens, slot = torch.where(chosen == expert)  # the tokens that chose it, and in which place
            y = self.experts[expert](x[tokens], ops) * weights[tokens, slot, None]  # (t, H)
            out.index_add_(0, tokens, y)
        return self._shared(x, ops, out)


class DecoderLayer(nn.Module):
    """Attention then MLP, each added to the residual stream. Llama's: each block's input
    normalized (``post_attention_layernorm`` is the MLP's input norm); with ``sandwich_norms``
    (Gemma 3), each block's output normalized too (``post_attention_layernorm`` is the attention's
    output norm, ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` the MLP's); with
    ``sandwich_norms`` and no ``input_norms`` (OLMo 2), only the outputs (no ``input_layernorm``,
    no ``pre_feedforward_layernorm``)."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        h, eps, offset, f32 = (
            config.hidden_size,
            config.rms_norm_eps,
            config.norm_offset,
            config.norm_weight_float32,
        )
        sandwich, inputs = config.sandwich_norms, config.input_norms
        self.input_layernorm = RMSNorm(h, eps, offset, f32) if inputs else None
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(h, eps, offset, f32)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset, f32) if sandwich and inputs else None
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset, f32) if sandwich else None
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config)
            if layer in config.moe_layers
            else MLP(h, config.intermediate_size, config.mlp_bias, config.hidden_act)
        )
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1.0 elsewhere

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: AttentionPlan,
        layer: int = 0,
        ops: ModuleType | None = None,
    ) -> torch.Tensor:
        """``ops``: the native kernels for attention and the MLP (LlamaForCausalLM.ops), or None."""
        x = h if self.input_layernorm is None else self.input_layernorm(h)  # (T, H)
        attn = self.self_attn(x, cos, sin, k_cache, v_cache, meta, plan, layer, ops)  # (T, H)
        if self.post_feedforward_layernorm is None:
            m = self.residual_multiplier
            if m != 1.0:  # Granite: each block's output scaled before it is added
                h = h + attn * m  # (T, H)
                return h + self.mlp(self.post_attention_layernorm(h), ops) * m  # (T, H)
            h = h + attn  # (T, H)
            return h + self.mlp(self.post_attention_layernorm(h), ops)  # (T, H)
        h = h + self.post_attention_layernorm(attn)  # (T, H)
        mlp_in = h if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(h)  # (T, H)
        return h + self.post_feedforward_layernorm(self.mlp(mlp_in, ops))  # (T, H)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (Hugging Face's ``model.*`` tensors)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config.norm_offset, config.norm_weight_float32
        )


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus LM head; the KV cache is an argument, never state.

    ``ops``, when set (by the engine, to ``yutu.engine.native``'s kernels on CPU), runs each layer's
    elementwise steps as one native call each: the residual add with the next RMSNorm, q and k's
    rotation in place, silu(gate) * up. They round as the torch code does (the reference, which
    runs when ``ops`` is None; a test holds the two together). At one decode token they replace
    ~25 small tensor operations per layer; at a long prompt, several passes over its activations.
    """

    ops: ModuleType | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's sliding layers rotate by a base of their own, unscaled
        self.sliding_rotary = (
            None
            if config.sliding_rope_theta is None
            else RotaryEmbedding(replace(config, rope_theta=config.sliding_rope_theta, rope_scaling=None))
        )
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run one flat batch; returns final hidden states (T, H).

        input_ids, positions: (T,) int64. kv_cache: (num_blocks, num_layers, 2, block_size, kvh, hd)
        in the model's dtype. Writes the batch's K/V at ``meta.slot_mapping`` in every layer, then
        each sequence's chunk attends causally over its whole cached context.
        """
        self._check_cache(kv_cache)
        block_size = kv_cache.shape[3]
        h = self.model.embed_tokens(input_ids)  # (T, H)
        if self.config.embedding_scale is not None:  # Gemma: the scale rounded to the model's dtype first
            h = h * torch.tensor(self.config.embedding_scale, dtype=h.dtype)  # (T, H)
        if self.config.embedding_multiplier is not None:  # Granite: a plain product
            h = h * self.config.embedding_multiplier  # (T, H)
        tables = self._rotations(positions, h.dtype)  # per layer: (cos, sin), each (T, rd)
        plans: dict[int | None, AttentionPlan] = {}  # one per distinct sliding window
        group_tokens = self._decode_group_tokens(kv_cache)
        for i in range(len(self.model.layers)):
            window = self.config.layer_sliding_window(i)
            if window not in plans:
                plans[window] = build_attention_plan(meta, block_size, h.device, window, group_tokens)
        # The native layer loop is Llama's: one norm per block input, the weight itself. Elsewhere
        # (Gemma's sandwich norms, norms scaling by 1 + weight) the kernels run attention and the
        # MLP, torch the norms.
        if self.ops is not None and not self.config.sandwich_norms and not self.config.norm_offset:
            return self._forward_ops(self.ops, h, tables, kv_cache, meta, plans)
        for i, layer in enumerate(self.model.layers):
            layer_cache = kv_cache[:, i]  # (num_blocks, 2, bs, kvh, hd)
            plan = plans[self.config.layer_sliding_window(i)]
            h = layer(h, *tables[i], layer_cache[:, 0], layer_cache[:, 1], meta, plan, i, self.ops)
        return self.model.norm(h)  # (T, H)

    def _rotations(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) tables, (T, rd) each (rd = config.rope_dim): the model's RoPE, a
        sliding layer's own where it has one (Gemma 3), and the identity (cos 1, sin 0: exactly x
        again) for a layer without RoPE (SmolLM3's NoPE layers)."""
        c = self.config
        full = self.rotary(positions, dtype)
        sliding = full if self.sliding_rotary is None else self.sliding_rotary(positions, dtype)
        none = (torch.ones_like(full[0]), torch.zeros_like(full[1])) if c.nope_layers else full
        return [
            none if i in c.nope_layers else full if c.layer_sliding_window(i) is None else sliding
            for i in range(c.num_layers)
        ]

    def _forward_ops(self, ops: ModuleType, h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
                     kv_cache: torch.Tensor, meta: AttentionMetadata,
                     plans: dict[int | None, AttentionPlan]) -> torch.Tensor:  # fmt: skip
        """The layers of :meth:`forward` on the native kernels: the residual stream kept apart from
        each block's normalized input, each residual add done with the next norm in one call."""
        layers = cast("list[DecoderLayer]", list(self.model.layers))
        inputs = [cast(RMSNorm, layer.input_layernorm) for layer in layers]  # every block's (Llama's loop)
        norms = inputs[1:] + [cast(RMSNorm, self.model.norm)]
        residual = h  # (T, H), added to in place (the embedding's output, this call's own)
        x = ops.rms_norm(h, inputs[0].weight, inputs[0].eps)  # (T, H)
        m = self.config.residual_multiplier  # Granite's; 1.0 elsewhere
        for i, (layer, next_norm) in enumerate(zip(layers, norms, strict=True)):
            layer_cache = kv_cache[:, i]  # (num_blocks, 2, bs, kvh, hd)
            plan = plans[self.config.layer_sliding_window(i)]
            x = layer.self_attn(
                x, *tables[i], layer_cache[:, 0], layer_cache[:, 1], meta, plan, i, ops
            )  # (T, H)
            if m != 1.0:
                x.mul_(m)  # the attention's output, this call's own
            norm = layer.post_attention_layernorm
            ops.add_rms_norm_(x, residual, norm.weight, norm.eps)  # residual += x; x = norm(residual)
            x = layer.mlp(x, ops)  # (T, H)
            if m != 1.0:
                x.mul_(m)
            ops.add_rms_norm_(x, residual, next_norm.weight, next_norm.eps)
        return x  # (T, H): the final norm of the residual stream

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) hidden states -> (N, V) float32 logits (Gemma 2's soft-capped: cap * tanh(x / cap))."""
        logits = self.lm_head(hidden).float()  # (N, V)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _decode_group_tokens(self, kv_cache: torch.Tensor) -> int | None:
        """Keys per padded decode attention call: all at once on GPUs; on CPUs few enough that the
        gathered K (or V) of a group fits in cache (measured: faster than one big call or one per
        sequence)."""
        if kv_cache.device.type != "cpu":
            return None
        bytes_per_token = self.config.num_kv_heads * self.config.head_dim * kv_cache.element_size()
        return max(1, CPU_DECODE_GROUP_BYTES // bytes_per_token)

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        c = self.config
        if (
            kv_cache.dim() != 6
            or kv_cache.shape[1:3] != (c.num_layers, 2)
            or kv_cache.shape[4:] != (c.num_kv_heads, c.head_dim)
        ):
            raise ValueError(
                f"kv_cache has shape {tuple(kv_cache.shape)}; expected (num_blocks, {c.num_layers}, 2, "
                f"block_size, {c.num_kv_heads}, {c.head_dim}) -- allocate it with config.kv_cache_shape()"
            )
        if kv_cache.dtype != self.model.embed_tokens.weight.dtype:
            raise ValueError(
                f"kv_cache dtype {kv_cache.dtype} differs from the model's {self.model.embed_tokens.weight.dtype}"
            )
