"""The engine on a GPU (skipped without one): the CPU in float32 is the reference.

- float32 on CUDA gives the CPU engine's greedy tokens, and logprobs within 1e-4, for a batch of
  prompts of mixed lengths with chunked prefill, and its prefix cache gives the cold tokens;
- bfloat16 (what ``--dtype auto`` picks on CUDA) tracks transformers in float32 on the CPU within 0.1
  in logprob, as on the CPU (tests/engine/test_engine_dtype.py);
- the dense decode cache, off by default on CUDA, computes what paged attention does there;
- seeded sampling draws the same tokens twice on the GPU, and batched as alone.

``loadtests/gpu_check.sh`` runs these with the engine suites on CUDA (``YUTU_TEST_DEVICE=cuda``) and
``loadtests/bench_engine.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import make_engine, prompt
from yutu.engine.engine import LLMEngine
from yutu.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

Result = dict[str, tuple[list[int], list[float]]]
MIXED = {"a": (5, 20), "b": (37, 16), "c": (90, 12), "d": (130, 8)}  # prompt tokens, output tokens


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> Result:
    out: Result = {rid: ([], []) for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or ())
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    return out


def greedy_batch() -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        rid: (
            prompt(n, seed=500 + i),
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0),
        )
        for i, (rid, (n, m)) in enumerate(MIXED.items())
    }


def assert_close(got: Result, ref: Result, tol: float) -> None:
    assert got.keys() == ref.keys()
    for rid in ref:
        assert got[rid][0] == ref[rid][0], rid
        assert got[rid][1] == pytest.approx(ref[rid][1], abs=tol), rid


@pytest.mark.parametrize("budget", [512, 32])  # one prefill step, and chunks of 32 mixed with decodes
def test_float32_on_cuda_matches_the_cpu(ckpt: Path, budget: int) -> None:
    gpu = make_engine(ckpt, device="cuda", max_num_batched_tokens=budget)
    assert gpu.runner.kv_cache.device.type == "cuda" and gpu.kernels == "torch"
    ref = run(make_engine(ckpt, device="cpu", max_num_batched_tokens=budget), greedy_batch())
    assert_close(run(gpu, greedy_batch()), ref, 1e-4)


def test_prefix_cache_on_cuda_gives_the_cold_tokens(ckpt: Path) -> None:
    base = prompt(70, seed=1)
    other = base[:64] + prompt(12, seed=2)  # four full blocks of 16 shared
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    cold = run(make_engine(ckpt, device="cuda"), {"b": (other, params)})
    engine = make_engine(ckpt, device="cuda")
    run(engine, {"a": (base, params)})
    assert_close(run(engine, {"b": (other, params)}), cold, 1e-5)
    assert engine.stats().prefix_cache_hit_tokens == 64


def test_bfloat16_on_cuda_tracks_transformers_in_float32(ckpt: Path) -> None:
    transformers = pytest.importorskip("transformers")
    engine = make_engine(ckpt, device="cuda", dtype="auto")
    assert engine.dtype == torch.bfloat16 and engine.kv_salt.endswith("@bfloat16")
    got = run(engine, greedy_batch())
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for rid, (ids, _) in greedy_batch().items():
        tokens, logprobs = got[rid]
        with torch.no_grad():  # transformers teacher-forced on our tokens: its logprob of each
            logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert logprobs == pytest.approx(ref.tolist(), abs=0.1), rid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_decode_cache_on_cuda_matches_paged_attention(ckpt: Path, dtype: str) -> None:
    dense = make_engine(ckpt, device="cuda", dtype=dtype, dense_decode_bytes=1 << 20)
    assert dense.runner.dense is not None
    paged = make_engine(ckpt, device="cuda", dtype=dtype)
    assert paged.runner.dense is None  # off by default on CUDA
    tol = 1e-5 if dtype == "float32" else 0.05
    assert_close(run(dense, greedy_batch()), run(paged, greedy_batch()), tol)


def test_seeded_sampling_on_cuda_repeats_and_ignores_the_batch(ckpt: Path) -> None:
    ids = prompt(12, seed=300)
    seeded = SamplingParams(temperature=3.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = run(make_engine(ckpt, device="cuda"), {"s": (ids, seeded)})["s"][0]
    again = run(make_engine(ckpt, device="cuda"), {"s": (ids, seeded)})["s"][0]
    noise = SamplingParams(temperature=3.0, max_tokens=7, ignore_eos=True)
    batched = run(make_engine(ckpt, device="cuda"), {"n": (prompt(30, seed=301), noise), "s": (ids, seeded)})
    assert alone == again == batched["s"][0]
    assert len(set(alone)) > 5  # high-entropy sampling, not a constant
