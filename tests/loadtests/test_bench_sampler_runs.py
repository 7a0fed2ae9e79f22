"""loadtests/bench_sampler.py runs end to end: every shape measured for both versions, the ratios
printed (a smoke test of the script: timings are not checked; that the two versions sample from
the same distribution, and the kernel's greedy rows what torch's operations pick, is
tests/engine/test_engine_sampler.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_sampler_run_measures_every_shape(tmp_path: Path) -> None:
    out = tmp_path / "bench_sampler.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_sampler.py"), "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["rows"], r["vocab"], r["batch"]) for r in rows} == {
        (name, vocab, batch)
        for name in ("free", "top_p", "greedy", "greedy_logprobs", "penalized", "constrained")
        for vocab in (2_560, 32_000, 128_256)
        for batch in (1, 16)
    }
    versions = [r for r in rows if r["rows"] not in ("penalized", "constrained")]
    assert all(r["plain"] > 0 and r["sampler"] > 0 and r["plain_over_sampler"] > 0 for r in versions)
    costs = [r for r in rows if r["rows"] in ("penalized", "constrained")]
    assert all(r["without"] > 0 and r["with"] > 0 and r["with_over_without"] > 0 for r in costs)
    assert all(r["torch"] > 0 and r["native"] > 0 and r["torch_over_native"] > 0 for r in costs)
    grammar = [r for r in rows if r["rows"] == "constrained"]
    assert all(r["view_s"] > 0 and r["compile_ms"] > 0 and r["fill_us"] > 0 for r in grammar)
    assert proc.stdout.count("x\n") == len(rows) - len(grammar)  # a constrained row ends with its fill
    assert proc.stdout.count("one row's bitmask") == 3
