"""loadtests/bench_channel.py runs end to end: both transports deliver every message, measured.

A smoke test of the benchmark script (its figures are not checked here, only that a short run
completes, every message arrived on both transports and the JSON holds each figure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_channel_run_reports_both_transports(tmp_path: Path) -> None:
    out = tmp_path / "bench_channel.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_channel.py"), "--messages", "200", "--interval-ms", "0.2",
         "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["medians"]) == {"zeromq", "stream"}
    for figures in res["medians"].values():
        assert set(figures) == {
            "sender_cpu_us_per_msg",
            "receiver_cpu_us_per_msg",
            "latency_p50_us",
            "latency_p99_us",
        }
        assert 0 < figures["latency_p50_us"] <= figures["latency_p99_us"]
    assert "stream/zeromq" in proc.stdout
