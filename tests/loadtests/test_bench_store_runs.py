"""loadtests/bench_store.py runs end to end and reports every row, target and floor.

A smoke test of the benchmark script itself (it starts its own Redis, master and node): the numbers
are not checked here, only that a short run completes and its JSON holds what the issue asks for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_store_run_reports_every_measurement(tmp_path: Path) -> None:
    out = tmp_path / "bench_store.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_store.py"), "--seconds", "0.02", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    rows = {(r["size"], r["op"], r["mode"], r["transport"], r["api"]) for r in res["rows"]}
    sizes, apis = (
        (64 << 10, 1 << 20, 4 << 20),
        {"put": ("bytes", "zero-copy"), "get": ("bytes", "zero-copy", "zero-copy-warm")},
    )
    assert rows == {
        (size, op, mode, transport, api)
        for size in sizes
        for op in ("put", "get")
        for mode in ("single", "batch")
        for transport in ("tcp", "shm")
        for api in apis[op]
    }
    for row in res["rows"]:
        assert row["calls"] >= 3 and row["gbps"] > 0 and 0 < row["p50_us"] <= row["p99_us"]
    for size in sizes:
        base = res["baselines"][str(size)]
        assert set(base) == {"memcpy", "socket", "redis", "redis-hiredis", "redis-py"}
        for name in ("redis-hiredis", "redis-py"):
            assert set(base[name]) == {"put/single", "get/single", "put/batch", "get/batch"}
        for op, best in base["redis"].items():  # per operation, the faster client configuration
            assert best["gbps"] == max(base["redis-hiredis"][op]["gbps"], base["redis-py"][op]["gbps"])
    assert set(res["floors"]) == {"zmq_rtt", "redis_write"}
    assert all(f["p50_us"] > 0 for f in res["floors"].values())
    assert (
        len(res["targets"]) == 4 + 3 * 2 * 2
    )  # 4 MiB get vs socket/memcpy x2 modes; every size/op/mode vs Redis
    for t in res["targets"]:
        assert t["met"] == (t["ratio"] >= t["need"]) and t["reachable"] == (t["bound"] >= t["need"])
        assert f"[{'PASS' if t['met'] else 'MISS'}] {t['target']}: {t['ratio']:.2f}" in proc.stdout
