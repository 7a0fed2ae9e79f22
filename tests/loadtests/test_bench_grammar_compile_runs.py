"""loadtests/bench_grammar_compile.py runs end to end: both modes measured for every schema size,
the ratios printed (a smoke test of the script: timings are not checked; that a grammar compiled
off the step gives the output of one compiled on it is tests/engine/test_engine_structured.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_grammar_compile_run_measures_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "bench_grammar_compile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_grammar_compile.py"), "--rounds", "1",
         "--objects", "2,20", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["objects"] for r in rows] == [2, 20] and rows[0]["schema_bytes"] < rows[1]["schema_bytes"]
    for row in rows:
        for mode in ("off the step", "on the step"):
            assert row[mode]["gap_ms"] > 0 and row[mode]["stall_ms"] > 0 and row[mode]["ttft_ms"] > 0
    assert proc.stdout.count("on / off") == 2
