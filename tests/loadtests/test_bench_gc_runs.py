"""loadtests/bench_gc.py runs end to end on a tiny checkpoint: both heaps measured, then frozen, and
the store master's table.

A smoke test of the benchmark script: its pauses are not checked (timings), only that a short run
completes, each heap froze what it tracked, the master's table left nothing tracked where records
of the old shape leave four per object, and the JSON holds every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from yutu.engine.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_gc_run_measures_both_heaps(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-llama", arch="llama", seed=3)
    out = tmp_path / "bench_gc.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_gc.py"), "--model", str(checkpoint), "--repeat", "1",
         "--requests", "16", "--objects", "2000", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res) == {"engine", "gateway", "store-master"}
    table = res.pop("store-master")
    assert table["objects"] == 2000 and table["master_tracked_per_object"] < 0.05
    assert table["baseline_tracked_per_object"] >= 4.0 and table["both_ms"] >= 0 and table["master_ms"] >= 0
    for heap, figures in res.items():
        assert figures["tracked_objects"] > 10_000, heap
        assert figures["frozen_objects"] >= figures["tracked_objects"] * 0.9, heap  # what start-up left
        assert figures["unfrozen_ms"] > 0 and figures["frozen_ms"] >= 0
    assert res["engine"]["unfrozen_after_churn"] < res["engine"]["tracked_objects"] // 10
    assert "start-up heap walked" in proc.stdout and "store master, 2,000 objects" in proc.stdout
