"""Early rejection under overload: with a TTFT SLO, a burst beyond what the stack can serve in time
gets 429s (OpenAI envelope, Retry-After) decided before anything runs, and the requests it accepts
are served within the SLO."""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.disagg.disagg_support import DisaggStack, prompt

SLO_MS = 1000
BURST = 40


def test_a_burst_beyond_the_slo_is_rejected_early_and_the_accepted_meet_it(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    with DisaggStack(tmp_path, long_model, redis_url, conductor_flags=("--slo-ttft-ms", str(SLO_MS))) as s:
        # Until the cost models have measurements, nothing is rejected: the warm-up calibrates them.
        for i in range(12):
            assert s.complete(prompt(1500, seed=300 + i), max_tokens=2).status == 200
        with ThreadPoolExecutor(BURST) as pool:
            replies = list(
                pool.map(lambda i: s.complete(prompt(1500, seed=400 + i), max_tokens=2), range(BURST))
            )
        rejected = [r for r in replies if r.status == 429]
        accepted = [r for r in replies if r.status == 200]
        assert rejected and accepted, [r.status for r in replies]
        assert len(rejected) + len(accepted) == BURST
        for r in rejected:
            assert int(r.headers["retry-after"]) >= 1
            assert r.body["error"]["type"] == "overloaded_error"
            message = r.body["error"]["message"]
            assert "predicted TTFT" in message or "free KV blocks" in message, message  # too slow, or no room
        recent = {
            p["request_id"]: p
            for p in s.get("conductor", "conductor", "/placements/recent?limit=200")["placements"]
        }
        measured = [p["measured_ttft_s"] for p in recent.values() if p["measured_ttft_s"] is not None][
            : len(accepted)
        ]
        assert len(measured) == len(accepted)
        assert statistics.median(measured) <= SLO_MS / 1000
        within = sum(t <= SLO_MS / 1000 for t in measured)
        assert within >= 0.8 * len(measured), sorted(measured)
