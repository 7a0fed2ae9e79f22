"""The locustfile against the local stack: a 20 s headless run with zero failures (issue #11's CI smoke).

``yutu up`` with its default (disaggregated) topology on the demo model, on free ports and a Redis of
its own; locust with 4 users for 20 s. Checked from locust's CSV: requests of every kind were sent,
none failed, and the TTFT and ITL metrics of the streamed requests were recorded.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from yutu.engine.default_model import ensure_default_model
from yutu.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_twenty_seconds_of_locust_against_yutu_up_fail_nothing(tmp_path: Path) -> None:
    ensure_default_model()
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = (tmp_path / "up.out").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "yutu.cli", "up", "--port", str(port), "--redis-url",
         f"redis://127.0.0.1:{free_port()}/0", "--log-dir", str(tmp_path / "logs"),
         "--kv-cache-memory-mib", "64", "--store-segment-size", "64MiB"],
        stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240  # the banner: every instance found by the gateway and conductor
        while b"Ctrl-C stops everything" not in (tmp_path / "up.out").read_bytes():
            assert up.poll() is None, (tmp_path / "up.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "yutu up did not start"
            time.sleep(0.2)
        stats = tmp_path / "run"
        locust = subprocess.run(
            [str(Path(sys.executable).parent / "locust"), "-f", str(ROOT / "loadtests" / "locustfile.py"),
             "--headless", "-u", "4", "-r", "4", "--run-time", "20s", "--host", f"http://127.0.0.1:{port}",
             "--csv", str(stats), "--only-summary"],
            capture_output=True, text=True, timeout=120,
            env={**env, "YUTU_PROMPT_WORDS": "60", "YUTU_MAX_TOKENS": "12"},
        )  # fmt: skip
        assert locust.returncode == 0, locust.stdout[-3000:] + locust.stderr[-3000:]
        with (tmp_path / "run_stats.csv").open() as f:
            rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
        requests = {name: int(r["Request Count"]) for (kind, name), r in rows.items() if kind == "POST"}
        assert set(requests) == {"chat", "chat (stream)", "completion", "completion (stream)"}, rows.keys()
        assert all(n > 0 for n in requests.values()), requests
        assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
        assert int(rows[("metric", "TTFT")]["Request Count"]) > 0
        assert int(rows[("metric", "ITL")]["Request Count"]) > 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
        out.close()
    assert up.returncode == 0
