"""loadtests/bench_serving.py runs end to end at its smallest size and reports every figure.

A smoke test of the benchmark script itself (``--quick``: tiny shapes on a real ``yutu up --workers
1 --store-nodes 0`` stack with the demo model, and the engine alone in a subprocess with the same
shapes): the timings are not judged, only that every scenario and figure is measured on both sides,
the ratios are the figures' quotients, the targets are reported, and nothing is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from yutu.engine.default_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[2]
SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
FIGURES = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms"}


def test_the_quick_run_measures_every_scenario_on_the_stack_and_the_engine(tmp_path: Path) -> None:
    ensure_default_model()  # built once per machine, outside the bench's own time
    out = tmp_path / "bench_serving.json"
    before = set(SHM_ROOT.glob("yutu-bench-*"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_serving.py"), "--stacks", "mixed", "--quick",
         "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["shapes"]["sequential"] == 2 and res["shapes"]["concurrent"] == 4
    (name,) = res["stacks"]
    run = res["stacks"][name]
    assert name == "mixed" and "--workers 1" in run["command"] and "--store-nodes 0" in run["command"]
    setup = run["engine_setup"]  # what the engine-only run mirrored, from the worker's /info
    assert setup["torch"] >= 1
    assert setup["prefill"] >= setup["torch"]  # yutu up's rule (README)
    assert (setup["step_tokens"], setup["prefill_step_tokens"]) == (512, 2048)  # the worker's defaults
    assert (
        f"(engine: {setup['torch']} torch thread(s), {setup['prefill']} for a long prompt's chunks; steps of"
        f" {setup['step_tokens']} tokens, {setup['prefill_step_tokens']} where nothing decodes; medians of 2 rounds)"
        in proc.stdout
    )
    for side in ("stack", "engine_only"):
        assert set(run[side]) == {"sequential", "cached", "concurrent"}
        for scenario, figures in run[side].items():
            expected = FIGURES | ({"tok_s"} if scenario == "concurrent" else set())
            assert set(figures) == expected, (side, scenario)
            assert all(v > 0 for v in figures.values()), (side, scenario, figures)
    assert res["rounds"] == 2 and len(run["rounds"]) == 2 and "medians of 2 rounds" in proc.stdout
    for side in ("stack", "engine_only"):  # each figure printed is the median of the rounds'
        for scenario, figures in run[side].items():
            for fig, value in figures.items():
                assert value == statistics.median(r[side][scenario][fig] for r in run["rounds"])
    t = run["targets"]
    tpot = run["stack"]["sequential"]["tpot_p50_ms"] / run["engine_only"]["sequential"]["tpot_p50_ms"]
    tput = run["stack"]["concurrent"]["tok_s"] / run["engine_only"]["concurrent"]["tok_s"]
    assert t == {"tpot_b1_ratio": tpot, "tpot_b1_met": tpot <= 1.15, "throughput_ratio": tput,
                 "throughput_met": tput >= 0.85}  # fmt: skip
    assert f"TPOT at batch 1 <= 1.15x the engine's: {tpot:.2f}x" in proc.stdout
    assert f"16-concurrent tok/s >= 0.85x the engine's: {tput:.2f}x" in proc.stdout
    assert set(SHM_ROOT.glob("yutu-bench-*")) <= before  # its region-file folder is gone
