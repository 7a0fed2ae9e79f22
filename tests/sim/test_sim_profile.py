"""Profiles: the paper's parameters in the cost models' units, exact truth functions, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from yutu.sim.profile import PAPER_PROFILE, Profile, load_profile, paper_profile

from tests.sim.sim_support import tiny_profile


def test_the_paper_profile_follows_table_1_and_eq_1() -> None:
    p = paper_profile()
    assert p.kv_bytes_per_token == 80 * 2 * (8192 // 8) * 2 == 327_680  # 320 KiB, as the paper says
    assert p.block_size == 512 and p.bytes_per_block == 327_680 * 512
    g = 8 * 312e12
    a, b, c = p.prefill
    assert (a, b, c) == (0.0, 80 * 22 * 8192**2 / g, 80 * 4 * 8192 / g)
    # Eq. 1: flops(n) = l*(a*n^2*d + b*n*d^2); computing [p, L) costs flops(L) - flops(p).
    flops = lambda n: 80 * (4 * n * n * 8192 + 22 * n * 8192**2)  # noqa: E731
    assert p.prefill_s(8192, 0) == pytest.approx(flops(8192) / g, rel=1e-12)
    assert p.prefill_s(12_000, 8192) == pytest.approx((flops(12_000) - flops(8192)) / g, rel=1e-12)
    assert p.network_bps == 100e9  # 800 Gbps
    assert p.transfer_s(p.bytes_per_block) == pytest.approx(1e-3 + 167_772_160 / 100e9)
    assert p.cache_blocks == 3_000_000 // 512  # the paper's ~3M-token local DRAM cache
    # A 128-sequence step over 1M KV tokens: weights + KV read at 16.3 TB/s, plus per-sequence FLOPs.
    assert p.step_s(128, 1_000_000) == pytest.approx(
        141.2e9 / 16.312e12 + 128 * 141.2e9 / g + 1_000_000 * 327_680 / 16.312e12
    )


def test_cost_models_are_the_profile_as_trusted_priors() -> None:
    p = paper_profile()
    m = p.cost_models()
    assert m.prefill.calibrated and m.decode.calibrated  # early rejection believes them from the start
    assert m.prefill.predict(12_000, 4096) == pytest.approx(p.prefill_s(12_000, 4096), rel=1e-12)
    assert m.decode.predict(64, 500_000) == pytest.approx(p.step_s(64, 500_000), rel=1e-12)
    assert m.transfer.predict(10**9) == pytest.approx(p.transfer_s(10**9), rel=1e-12)


def test_edges_of_the_truth_functions() -> None:
    p = tiny_profile()
    assert p.transfer_s(0) == 0.0  # nothing to move costs nothing, not the latency
    assert p.prefill_s(9, 8) == 0.125  # one token
    with pytest.raises(ValueError, match="reused_tokens < prompt_len"):
        p.prefill_s(8, 8)  # the last token is always computed
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        tiny_profile(max_batch=0)
    with pytest.raises(ValueError, match="prefill must be 3 finite coefficients"):
        tiny_profile(prefill=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="network_bps must be a finite number > 0"):
        tiny_profile(network_bps=float("inf"))


def test_profile_files_round_trip_and_bad_ones_say_why(tmp_path: Path) -> None:
    p = tiny_profile()
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    assert load_profile(str(path)) == p
    assert load_profile(PAPER_PROFILE) == paper_profile()
    with pytest.raises(ValueError, match="neither paper-llama3-70b-a800 nor a profile file"):
        load_profile(str(tmp_path / "missing.json"))
    data = json.loads(p.to_json())
    del data["max_batch"]
    data["extra"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing fields \['max_batch'\], unknown fields \['extra'\]"):
        load_profile(str(path))
    assert Profile.from_dict(json.loads(p.to_json())).prefill == (0.0, 0.125, 0.0)
