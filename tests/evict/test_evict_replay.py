"""loadtests/eviction_replay.py: exact hits on a hand-made trace, and the script's table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "loadtests"))

from eviction_replay import replay, unlimited_hits  # noqa: E402

# Blocks 0 and 1 are read by three requests; the last request reads 2 and 0 behind a new block 5.
REQUESTS = [[0, 1, 2], [0, 1, 3], [0, 1, 4], [5, 2, 0]]


def test_exact_hits_per_policy() -> None:
    assert unlimited_hits(REQUESTS) == (6, 12)
    lru = replay("lru", 3, REQUESTS)
    # [0,1,2]: 3 misses; [0,1,3]: 2 hits, evicts 2; [0,1,4]: 2 hits, evicts 3; [5,2,0]: 5 evicts 0,
    # 2 evicts 1, 0 evicts 4 -- three misses
    assert (lru.lookups, lru.hits, lru.evictions) == (12, 4, 5)
    lfu = replay("lfu", 3, REQUESTS)  # 0 and 1 count 3: 5 evicts 4, 2 evicts 5, 0 hits
    assert (lfu.hits, lfu.evictions) == (5, 4)
    arc = replay("adaptive", 3, REQUESTS)  # 0 and 1 move to the frequency part; T1 takes the misses
    assert (arc.hits, arc.evictions) == (5, 4)
    assert replay("lru", 1, REQUESTS).hits == 0


def test_prefix_counting_stops_at_the_first_miss() -> None:
    assert unlimited_hits(REQUESTS, prefix=True) == (4, 12)  # [5,2,0]: 5 misses, so no reuse
    assert replay("lru", 3, [[0, 1], [9, 0, 1]], prefix=True).hits == 0
    assert replay("lru", 3, [[0, 1], [9, 0, 1]]).hits == 2
    assert replay("lru", 3, [[0, 1], [0, 1]], prefix=True).hits == 2


def test_the_script_prints_a_row_per_capacity(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids})
            + "\n"
            for i, ids in enumerate(REQUESTS)
        )
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "eviction_replay.py"), str(trace), "--capacities", "1,3",
         "--json", str(tmp_path / "rows.json")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = out.stdout.splitlines()
    assert "12 block reads, 6 distinct blocks" in lines[0] and "unlimited cache 50.00%" in lines[0]
    assert lines[2].split() == ["1", "16.7%", "0.00%", "0.00%", "0.00%"]
    assert lines[3].split() == ["3", "50.0%", "33.33%", "41.67%", "41.67%"]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(r["policy"], r["capacity"], r["hits"]) for r in rows] == [
        ("lru", 1, 0), ("lfu", 1, 0), ("adaptive", 1, 0), ("lru", 3, 4), ("lfu", 3, 5), ("adaptive", 3, 5),
    ]  # fmt: skip
