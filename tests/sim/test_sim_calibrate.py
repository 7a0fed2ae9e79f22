"""``yutu calibrate``: the fit recovers exact coefficients; a real tiny engine gives a usable profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from yutu.engine.testing import make_tiny_checkpoint
from yutu.sim.calibrate import Samples, fit_profile, measure
from yutu.sim.profile import load_profile


def test_the_fit_recovers_exact_coefficients() -> None:
    prefill = lambda L, p: 0.01 + 1e-4 * (L - p) + 1e-7 * (L - p) * (L + p)  # noqa: E731
    step = lambda b, kv: 0.004 + 5e-4 * b + 2e-6 * kv  # noqa: E731
    points = [(64, 0), (256, 0), (512, 0), (512, 256), (384, 128), (128, 64)]
    batches = [(1, 64), (4, 256), (8, 512), (16, 4096), (2, 2048)]
    samples = Samples(
        [(L, p, prefill(L, p)) for L, p in points], [(b, kv, step(b, kv)) for b, kv in batches],
        copy_bps=1e10, kv_bytes_per_token=2048, kv_pool_tokens=512 * 300, max_batch=64,
    )  # fmt: skip
    profile = fit_profile(samples, "exact")
    assert profile.prefill == pytest.approx((0.01, 1e-4, 1e-7), rel=1e-6)
    assert profile.decode == pytest.approx((0.004, 5e-4, 2e-6), rel=1e-6)
    assert (profile.block_size, profile.cache_blocks, profile.bytes_per_block) == (512, 300, 512 * 2048)
    with pytest.raises(ValueError, match="at least 3 prefill and 3 decode samples"):
        fit_profile(Samples(samples.prefills[:2], samples.steps, 1e10, 2048, 512, 64), "few")


def test_a_real_tiny_engine_calibrates_into_a_loadable_profile(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "tiny")
    samples = measure(model, [(32, 0), (64, 0), (64, 32), (96, 32)], [(1, 32), (2, 32), (4, 48)], repeats=1,
                      kv_cache_mib=8, max_batch=8)  # fmt: skip
    assert [(L, p) for L, p, _ in samples.prefills] == [(32, 0), (64, 0), (64, 32), (96, 32)]
    assert all(s > 0 for _, _, s in samples.prefills + samples.steps)
    # Each decode sample ran its whole batch, whose KV is the prompts plus the tokens decoded so far.
    assert [b for b, _, _ in samples.steps] == [1, 2, 4]
    assert [
        kv >= b * c for (b, kv, _), (_, c) in zip(samples.steps, [(1, 32), (2, 32), (4, 48)], strict=True)
    ] == [True] * 3
    profile = fit_profile(samples, "tiny-cpu")
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    loaded = load_profile(str(path))
    assert loaded == profile and loaded.prefill_s(1024, 512) > 0 and loaded.max_batch == 8
