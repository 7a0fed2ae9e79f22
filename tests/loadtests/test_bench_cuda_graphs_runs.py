"""loadtests/bench_cuda_graphs.py runs end to end (on the CPU: the eager step alone; the graph is
measured where a GPU is, by loadtests/gpu_check.sh). A smoke test of the script, not a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_cuda_graphs_run_times_both_batches(tmp_path: Path) -> None:
    out = tmp_path / "bench_cuda_graphs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_cuda_graphs.py"), "--steps", "2", "--context", "64",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["context"] == 64 and res["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    for batch in ("batch_1", "batch_16"):
        assert res[batch]["eager_ms"] > 0
        if res["device"] == "cuda":  # the graph replays the eager step: same logits up to bfloat16
            assert res[batch]["max_abs_diff"] < 0.05 and res[batch]["graph_ms"] > 0
    assert "batch 16: eager" in proc.stdout
