"""loadtests/bench_disagg.py runs its store-hit scenario end to end and reports every field.

A smoke test of the benchmark script itself, at its smallest size (one pair of 512-token prompts on
a real ``yutu up --prefill 2 --decode 1`` stack with the demo model): the timings are not judged,
only that the run completes, its promises hold (B on the other prefill instance, fetched from the
store) and its report and JSON say what the issue asks for, with nothing left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from yutu.engine.default_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[2]
SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def test_the_smallest_store_hit_run_reports_every_field(tmp_path: Path) -> None:
    ensure_default_model()  # built once per machine, outside the bench's own time
    out = tmp_path / "bench_disagg.json"
    before = set(SHM_ROOT.glob("yutu-bench-*"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_disagg.py"), "--only", "store-hit",
         "--lengths", "512", "--reps", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["only"] == ["store-hit"] and res["problems"] == [] and res["leftovers"] == {}
    hit = res["scenarios"]["store-hit"]
    assert "--prefill 2 --decode 1 --policy round_robin --disagg-threshold 0" in hit["stack"]
    assert hit["block_size"] == 16 and hit["max_tokens"] == 4
    (row,) = hit["rows"]
    assert row["length"] == 512 and row["reps"] == 1 and row["min_cached_tokens"] >= 496
    (pair,) = row["pairs"]
    assert {pair["cold_prefill"], pair["hit_prefill"]} == {"prefill-0", "prefill-1"}
    assert pair["hit_cached_tokens"] >= 496 and pair["fetched_blocks"] >= 31
    assert row["cold_ttft_ms"] == pair["cold_ttft_s"] * 1e3 and row["hit_ttft_ms"] == pair["hit_ttft_s"] * 1e3
    assert row["ratio"] == row["hit_ttft_ms"] / row["cold_ttft_ms"] > 0
    target = hit["target"]
    assert target == {"length": 512, "need": 0.5, "ratio": row["ratio"], "met": row["ratio"] <= 0.5}
    assert (
        f"[{'PASS' if target['met'] else 'MISS'}] hit <= 0.5x cold at 512: {row['ratio']:.2f}x" in proc.stdout
    )
    assert (
        f"{512:>6}{row['cold_ttft_ms']:>10.1f}{row['hit_ttft_ms']:>10.1f}{row['ratio']:>10.2f}" in proc.stdout
    )
    assert "no problems" in proc.stdout
    assert set(SHM_ROOT.glob("yutu-bench-*")) <= before  # its region-file folder is gone
