"""loadtests/bench_serving.py runs end to end at its smallest size and reports every figure.

A smoke test of the benchmark script itself (``--quick``: tiny shapes on a real ``yutu up --workers
1 --store-nodes 0`` stack with the demo model, and the engine alone in a subprocess with the same
shapes): the timings are not judged, only that every scenario and figure is measured on both sides,
the ratios are the figures' quotients, the targets are reported, a small trace is replayed through
the stack, and nothing is left in /dev/shm. And the trace row's rules, on given token times.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from yutu.engine.default_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "loadtests"))

from bench_serving import trace_figures  # noqa: E402

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
FIGURES = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms"}


def test_the_quick_run_measures_every_scenario_on_the_stack_and_the_engine(tmp_path: Path) -> None:
    ensure_default_model()  # built once per machine, outside the bench's own time
    out = tmp_path / "bench_serving.json"
    trace = tmp_path / "trace.jsonl"  # five requests, two sharing a prefix; 512-token blocks become 64
    lines = [(0, 700, 40, [0, 1]), (100, 900, 60, [0, 2]), (150, 300, 20, [3]), (400, 1100, 90, [4, 5, 6]),
             (420, 520, 9, [7, 8])]  # fmt: skip
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
                             for t, n, o, h in lines))  # fmt: skip
    before = set(SHM_ROOT.glob("yutu-bench-*"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_serving.py"), "--stacks", "mixed", "--quick",
         "--rounds", "2", "--trace", str(trace), "--trace-speed", "2", "--out", str(out)],
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
    assert setup["prefill"] >= setup["torch"]  # yutu up's rule (README, "Engines and CPUs")
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
    assert res["extras"] == {
        "trace": str(trace),
        "trace_requests": 200,
        "trace_speed": 2.0,
        "vllm_client": False,
        "client_runs": 3,
    }
    figures = run["extra"]["trace"]  # and no vLLM client without --vllm
    assert set(run["extra"]) == {"trace"}
    assert figures["failed"] == 0 and 0 <= figures["slo_share"] <= 1
    assert (
        figures["ttft_p99_ms"] >= figures["ttft_p50_ms"] > 0
        and figures["tbt_p99_ms"] >= figures["tbt_p50_ms"] > 0
    )
    row = "".join(f"{figures[f]:>13.2f}" for f in figures)
    assert "Mooncake trace, open loop (trace):" in proc.stdout and f"  {'mixed':<16}{row}" in proc.stdout
    assert set(SHM_ROOT.glob("yutu-bench-*")) <= before  # its region-file folder is gone


def test_the_trace_row_counts_a_request_meeting_both_slos_of_every_one_sent() -> None:
    steady = [0.2 + 0.01 * i for i in range(50)]  # TTFT 200 ms, every gap 10 ms: meets both
    slow_start = [1.5 + 0.01 * i for i in range(50)]  # TTFT 1.5 s: misses
    stalled = [0.1 + 0.01 * i for i in range(40)] + [1.2 + 0.01 * i for i in range(10)]  # a 710 ms gap
    single = [0.3]  # one token: no gaps, so no TBT; its TTFT meets
    figures = trace_figures([steady, slow_start, stalled, single, None])  # None: failed
    assert figures["slo_share"] == pytest.approx(2 / 5)
    assert figures["failed"] == 1.0
    assert figures["ttft_p50_ms"] == pytest.approx(300.0) and figures["ttft_p99_ms"] == pytest.approx(1500.0)
    # TBT: the mean of a request's worst 10% of gaps (five of 49): 10 ms steady, (710 + 4 x 10) / 5 stalled
    assert figures["tbt_p50_ms"] == pytest.approx(10.0) and figures["tbt_p99_ms"] == pytest.approx(150.0)
