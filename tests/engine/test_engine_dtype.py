"""--dtype: what ``auto`` picks for a machine, the KV salt that keeps dtypes apart, bfloat16 parity.

bfloat16 keeps 8 bits of mantissa, so it is held to transformers' float32 logprobs within 0.1 (the
float32 engine is held to 1e-5 elsewhere); greedy equality is only asked of float32.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_support import make_engine, prompt
from yutu.engine.engine import LLMEngine, kv_salt
from yutu.engine.loader import auto_dtype, cpu_flags
from yutu.engine.sampling import SamplingParams

from services.gateway.routing import DisaggRouter

transformers = pytest.importorskip("transformers")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("device", "flags", "expected"),
    [
        (CUDA, frozenset(), torch.bfloat16),  # the GPU default, whatever the host CPU has
        (CPU, frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}), torch.bfloat16),  # AMX
        (CPU, frozenset({"avx2", "avx512f", "avx512_bf16"}), torch.bfloat16),  # AVX512-BF16, measured faster
        (CPU, frozenset({"avx2"}), torch.float32),
        (CPU, frozenset(), torch.float32),  # flags unknown
    ],
)
def test_auto_picks_the_documented_dtype_for_each_machine(
    device: torch.device, flags: frozenset[str], expected: torch.dtype
) -> None:
    assert auto_dtype(device, flags) == expected


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_dtype_salts_the_block_keys(ckpt: Path) -> None:
    assert kv_salt("m", torch.float32) == "m" and kv_salt("m", torch.bfloat16) == "m@bfloat16"
    f32, bf16 = make_engine(ckpt, dtype="float32"), make_engine(ckpt, dtype="bfloat16")
    assert f32.kv_salt == ckpt.name and bf16.kv_salt == f"{ckpt.name}@bfloat16"
    assert f32.root_key != bf16.root_key  # no block of one is ever taken for the other's
    with pytest.raises(ValueError, match="not one of auto, float32, bfloat16, float16"):
        make_engine(ckpt, dtype="int8")


def test_bfloat16_engine_tracks_transformers_in_float32(ckpt: Path) -> None:
    engine: LLMEngine = make_engine(ckpt, dtype="bfloat16")
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompts = {f"r{i}": prompt(n, seed=70 + i) for i, n in enumerate((12, 40, 90))}
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(
            rid, ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
        )
    while engine.has_unfinished_requests():  # three at once: prefill, then batched decodes
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.new_logprobs or ())
    for rid, ids in prompts.items():
        tokens, logprobs = got[rid]
        with torch.no_grad():  # transformers teacher-forced on our tokens: its logprob of each
            logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert logprobs == pytest.approx(ref.tolist(), abs=0.1), rid


def test_the_gateway_salts_keys_as_the_decode_instances_say() -> None:
    def pool(*salts: str | None) -> SimpleNamespace:
        return SimpleNamespace(workers={i: SimpleNamespace(info=SimpleNamespace(kv_salt=s, block_size=16))
                                        for i, s in enumerate(salts)})  # fmt: skip

    def router(decodes: SimpleNamespace) -> DisaggRouter:
        return DisaggRouter(decodes, None, None, "tiny", None)  # type: ignore[arg-type]

    from yutu.errors import YutuError
    from yutu.kv.hashing import root_key

    assert router(pool()).root_key == root_key("tiny")  # none yet: the model directory's name
    assert router(pool(None)).root_key == root_key("tiny")  # an instance that does not say
    assert router(pool("tiny@bfloat16", "tiny@bfloat16")).root_key == root_key("tiny@bfloat16")
    with pytest.raises(YutuError, match="disagree on the KV salt"):
        _ = router(pool("tiny", "tiny@bfloat16")).root_key
