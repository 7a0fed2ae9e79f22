"""loadtests/bench_moe.py runs end to end, small: every figure and ratio in its JSON (its timings are
not checked), its checkpoints' temporary directory gone."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_moe_run_reports_every_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench_moe.json"
    before = set(Path(tempfile.gettempdir()).glob("yutu-bench-moe-*"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_moe.py"), "--rounds", "1", "--tokens", "4",
         "--experts", "4", "--expert-width", "32", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res) == {"dense_b1", "moe_b1", "moe_reference_b1", "dense_b16", "moe_b16", "moe_reference_b16",
                        "moe_over_dense_b1", "moe_over_dense_b16", "one_token_path_over_reference_b1",
                        "grouped_path_over_reference_b16"}  # fmt: skip
    assert all(value > 0 for value in res.values())
    assert res["moe_over_dense_b16"] == res["moe_b16"] / res["dense_b16"]
    assert res["grouped_path_over_reference_b16"] == res["moe_b16"] / res["moe_reference_b16"]
    assert "the mixture's one-token path against its general path" in proc.stdout
    assert "the mixture's tokens grouped by expert against its general path" in proc.stdout
    assert set(Path(tempfile.gettempdir()).glob("yutu-bench-moe-*")) <= before
