"""The native layer kernels (yutu.engine.native: rms_norm, add_rms_norm_, rotary_, silu_mul) against
the model's torch code, their reference; the KV copies (write_kv_, fill_slots_, fill_whole_) against torch's
indexed assignment; and the model run on them against the model without (in each dtype, fused
projections or not).

The kernels round to the activations' dtype wherever the torch code does, so in bfloat16 and
float16 they agree with it exactly but for the order of RMSNorm's sum of squares (one unit in the
last place, rarely); in float32, to float32's rounding. The engine runs on them when ``kernels``
resolves to native: greedy tokens and logprobs then equal the torch path's (float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_support import make_engine, prompt
from yutu.engine import native
from yutu.engine.loader import load_model
from yutu.engine.model import RMSNorm, apply_rotary, fuse_projections
from yutu.engine.sampling import SamplingParams
from yutu.engine.testing import make_tiny_checkpoint, prefill_decode_mixed_logits

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops() -> object:
    return native.load()  # built by `make test` before the tests


def assert_rounds_alike(out: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within one unit in the last place of the dtype (float32: within a few, as the kernels
    sum and multiply in another order)."""
    assert out.dtype == want.dtype and out.shape == want.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), want.float(), rtol=torch.finfo(out.dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_norms_round_as_the_torch_code(ops: object, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    wide = torch.randn(rows, 100, generator=gen).to(dtype)
    x = wide[:, :96]  # a view with a row stride past its width
    assert_rounds_alike(ops.rms_norm(x, norm.weight, norm.eps), norm.reference(x))  # type: ignore[attr-defined]

    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    summed = residual + x  # what the reference adds, rounded to dtype by torch
    delta = x.clone()
    ops.add_rms_norm_(delta, residual, norm.weight, norm.eps)  # type: ignore[attr-defined]
    assert torch.equal(residual, summed)  # the residual add rounds exactly as torch's
    assert_rounds_alike(delta, norm.reference(summed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "head_dim"), [(1, 32), (9, 64), (200, 48), (3, 128)])
def test_rotary_rounds_as_the_torch_code_and_keeps_to_its_heads(
    ops: object, dtype: torch.dtype, rows: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(rows, 10, head_dim, generator=gen).to(dtype)  # [ q (6) | k (2) | v (2) ]
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 100
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    want = apply_rotary(qkv[:, :8], cos, sin)
    rotated = qkv.clone()
    ops.rotary_(rotated[:, :8], cos, sin)  # type: ignore[attr-defined]
    assert_rounds_alike(rotated[:, :8], want)
    if dtype != torch.float32:
        assert torch.equal(rotated[:, :8], want)
    assert torch.equal(rotated[:, 8:], qkv[:, 8:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul_rounds_as_the_torch_code(ops: object, dtype: torch.dtype, rows: int) -> None:
    gate_up = (torch.randn(rows, 2 * 200, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    want = F.silu(gate_up[:, :200]) * gate_up[:, 200:]
    assert_rounds_alike(ops.silu_mul(gate_up), want)  # type: ignore[attr-defined]


def test_misshapen_inputs_are_refused(ops: object) -> None:
    x = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, torch.ones(8), 1e-5)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="differ in dtype"):
        ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-5)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.rms_norm(x.t(), torch.ones(4), 1e-5)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="even"):
        ops.rotary_(torch.zeros(2, 1, 5), torch.zeros(2, 5), torch.zeros(2, 5))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary_(torch.zeros(2, 1, 4), torch.zeros(3, 4), torch.zeros(3, 4))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_mul(torch.zeros(2, 5))  # type: ignore[attr-defined]


def greedy(
    engine: object, prompts: dict[str, list[int]], max_tokens: int = 12
) -> dict[str, tuple[list[int], list[float]]]:
    """Every prompt at once, greedy with logprobs: request -> (tokens, logprobs)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)  # type: ignore[attr-defined]
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in prompts}
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        for o in engine.step():  # type: ignore[attr-defined]
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or ())
    return out


def test_the_engine_on_the_native_ops_decodes_as_on_torchs(ckpt: Path, ops: object) -> None:
    prompts = {f"r{i}": prompt(n, seed=i) for i, n in enumerate([1, 5, 40, 90])}
    # a small step budget splits the long prompts into chunks beside the others' decodes
    on_ops = make_engine(ckpt, kernels="native", max_num_batched_tokens=32)
    on_torch = make_engine(ckpt, kernels="torch", max_num_batched_tokens=32)
    assert on_ops.runner.model.ops is not None and on_torch.runner.model.ops is None
    fast, ref = greedy(on_ops, prompts), greedy(on_torch, prompts)
    for rid in prompts:
        assert fast[rid][0] == ref[rid][0]
        assert fast[rid][1] == pytest.approx(ref[rid][1], abs=1e-5)


@pytest.mark.parametrize(
    ("dtype", "overrides", "fused", "atol"),
    [
        (torch.float32, {}, True, 1e-5),
        (torch.float32, {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}, True, 1e-5),
        (torch.float32, {}, False, 1e-5),  # Hugging Face's separate projections: rotary on torch's code
        # bfloat16: the prefill attention kernel rounds once where SDPA rounds its tiles (logits of
        # magnitude 2-7 here, where a bfloat16 step is 0.016-0.031): held to be no further from the
        # float32 model's logits than torch's operations are, give or take atol
        (torch.bfloat16, {}, True, 4e-2),
        (torch.float16, {"num_key_value_heads": 1}, True, 2e-2),
        (torch.float32, {"arch": "qwen3"}, True, 1e-5),  # q/k norms, then the in-place rotation
        (torch.float32, {"arch": "qwen3"}, False, 1e-5),
        (torch.bfloat16, {"arch": "qwen3"}, True, 4e-2),
        (torch.float32, {"arch": "qwen3_moe"}, True, 1e-5),  # each expert's silu * up on the kernel
        (torch.float32, {"arch": "mixtral"}, False, 1e-5),
        (torch.float32, {"arch": "phi3"}, True, 1e-5),
        (torch.float32, {"arch": "phi3", "partial_rotary_factor": 0.5}, True, 1e-5),  # rotary_ on half a head
        (torch.bfloat16, {"arch": "phi3", "partial_rotary_factor": 0.5}, True, 4e-2),
        (torch.float32, {"arch": "gemma3_text"}, True, 1e-5),  # the kernels in attention and the MLP only
        (torch.bfloat16, {"arch": "gemma3_text"}, True, 4e-2),
        (torch.float32, {"arch": "gemma"}, True, 1e-5),  # norms by 1 + weight: torch's, off the native loop
        (torch.float32, {"arch": "gemma2"}, True, 1e-5),  # soft-capped attention, capped in the kernels
        (torch.float32, {"arch": "granite"}, True, 1e-5),  # each block's output scaled before the fused add
        (torch.bfloat16, {"arch": "granite"}, True, 4e-2),
        (torch.float32, {"arch": "smollm3"}, True, 1e-5),  # the native rotation by identity tables (NoPE)
        (torch.float32, {"arch": "olmo2"}, True, 1e-5),  # q/k norms across all heads on the fused projection
        (torch.bfloat16, {"arch": "olmo2"}, True, 4e-2),
    ],
)
def test_the_model_on_the_native_ops_computes_what_it_does_without(
    tmp_path: Path, ops: object, dtype: torch.dtype, overrides: dict[str, Any], fused: bool, atol: float
) -> None:
    """A prefill, a decode and a batch of both, with and without ``model.ops``: the same logits (in
    float32; in 16-bit dtypes, as close to the float32 model's as torch's operations come)."""
    overrides = dict(overrides)
    model_dir = make_tiny_checkpoint(tmp_path, overrides.pop("arch", "llama"), seed=6, **overrides)
    ids = prompt(30, seed=24)
    out = {}
    for with_ops, run_dtype in ((False, dtype), (True, dtype), (None, torch.float32)):
        model, _ = load_model(model_dir, torch.device("cpu"), run_dtype)
        if fused:
            fuse_projections(model)
        model.ops = ops if with_ops else None  # type: ignore[assignment]
        out[with_ops] = prefill_decode_mixed_logits(model, ids).float()
    if dtype is torch.float32:
        assert torch.allclose(out[True], out[False], atol=atol, rtol=0), (out[True] - out[False]).abs().max()
    else:
        native_error, torch_error = ((out[k] - out[None]).abs().max().item() for k in (True, False))
        assert native_error <= torch_error + atol, (native_error, torch_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_copies_move_what_torchs_indexed_assignment_moves(ops: object, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    layers, blocks, block_size, kvh, hd = 2, 6, 4, 2, 8
    cache = torch.randn(blocks, layers, 2, block_size, kvh, hd, generator=gen).to(dtype)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]  # one layer's views, as the model passes them
    qkv = torch.randn(5, 3 * kvh, hd, generator=gen).to(dtype)  # k and v: strided views of a product
    k, v = qkv[:, kvh : 2 * kvh], qkv[:, 2 * kvh :]
    where_blocks, where_offsets = torch.tensor([5, 0, 0, 3, 2]), torch.tensor([3, 0, 1, 2, 0])
    want = cache.clone()
    want[:, 1, 0][where_blocks, where_offsets] = k
    want[:, 1, 1][where_blocks, where_offsets] = v
    ops.write_kv_(k_cache, v_cache, k, v, where_blocks, where_offsets)  # type: ignore[attr-defined]
    assert torch.equal(cache, want)  # that layer's slots written, nothing else touched

    k_buf = torch.randn(3, kvh, 10, hd, generator=gen).to(dtype)  # dense slots (slots, kvh, capacity, hd)
    v_buf = torch.randn(3, kvh, 10, hd, generator=gen).to(dtype)
    slots, positions = torch.tensor([2, 0, 2]), torch.tensor([9, 4, 0])
    want_k, want_v = k_buf.clone(), v_buf.clone()
    want_k[slots, :, positions] = k_cache[where_blocks[:3], where_offsets[:3]]
    want_v[slots, :, positions] = v_cache[where_blocks[:3], where_offsets[:3]]
    ops.fill_slots_(k_buf, v_buf, k_cache, v_cache, slots, positions, where_blocks[:3], where_offsets[:3])  # type: ignore[attr-defined]
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)

    table = torch.tensor([4, 1, 5])  # a whole context of 10 positions: two blocks and half of a third
    want_k, want_v = k_buf.clone(), v_buf.clone()
    want_k[1, :, :10] = k_cache[table].view(-1, kvh, hd)[:10].transpose(0, 1)  # DenseStep.fill's reference
    want_v[1, :, :10] = v_cache[table].view(-1, kvh, hd)[:10].transpose(0, 1)
    ops.fill_whole_(k_buf, v_buf, k_cache, v_cache, 1, 10, table)  # type: ignore[attr-defined]
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)  # slot 1's positions 0..9, nothing else

    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.fill_whole_(k_buf, v_buf, k_cache, v_cache, 1, 10, torch.tensor([4, 1, 6]))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="at least 3 blocks"):
        ops.fill_whole_(k_buf, v_buf, k_cache, v_cache, 1, 10, table[:2])  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="outside the buffers"):
        ops.fill_whole_(k_buf, v_buf, k_cache, v_cache, 3, 10, table)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv_(k_cache, v_cache, k, v, torch.tensor([6, 0, 0, 0, 0]), where_offsets)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="out of range"):
        ops.fill_slots_(k_buf, v_buf, k_cache, v_cache, slots, torch.tensor([10, 0, 0]), where_blocks[:3],
                        where_offsets[:3])  # type: ignore[attr-defined]  # fmt: skip
    with pytest.raises(RuntimeError, match="int64"):
        ops.write_kv_(k_cache, v_cache, k, v, where_blocks.int(), where_offsets)  # type: ignore[attr-defined]
