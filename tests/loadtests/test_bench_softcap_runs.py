"""loadtests/bench_softcap.py runs end to end: every case timed three ways and its ratios printed
(a smoke test of the script: timings are not checked; that the capped kernels compute the capped
attention is tests/engine/test_engine_native.py's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_softcap_run_times_every_case() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_softcap.py"), "--reps", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if re.search(r"(prefill|decode), ", line)]
    assert [row.split(",")[0] for row in rows] == [
        f"{dtype} {case}" for dtype in ("float32", "bfloat16") for case in ("prefill", "decode", "decode")
    ]
    assert all(len(re.findall(r"\d+\.\d+(?:ms|x)", row)) == 5 for row in rows)
