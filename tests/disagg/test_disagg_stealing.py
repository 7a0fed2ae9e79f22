"""Prefill stealing through real processes: a burst on one prefill and one decode instance.

The first request of the burst finds the prefill instance's queue empty and goes there; the next
ones find it queued while the decode idles, so the conductor has the decode prefill some of them
itself (``yutu.sched.placer``, step 5). Both paths give the tokens of a cold greedy run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.disagg.disagg_support import DisaggStack, prompt

LENGTHS = [400, 380, 360, 340, 320, 300, 280, 260]
MAX_TOKENS = 12


def test_a_burst_is_prefilled_on_both_instances_with_unchanged_output(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    prompts = [prompt(n, seed=100 + n) for n in LENGTHS]
    with DisaggStack(tmp_path, long_model, redis_url, prefill_stealing=True) as s:
        policy = s.get("conductor", "conductor", "/policy")
        assert policy["prefill_stealing"] is True
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda ids: s.complete(ids, max_tokens=MAX_TOKENS), prompts))
        assert all(r.status == 200 for r in replies), [r.body for r in replies]
        where = [r.headers["x-yutu-prefill"] for r in replies]
        assert {r.headers["x-yutu-decode"] for r in replies} == {"decode-0"}
        assert set(where) == {"prefill-0", "none"}, where  # some handed over, some stolen
        recent = s.get("conductor", "conductor", "/placements/recent")["placements"]
        stolen = [p for p in recent if "stolen from the queue of prefill prefill-0" in p["reason"]]
        assert len(stolen) == where.count("none")
        for ids, reply in zip(prompts, replies, strict=True):
            assert reply.tokens == s.reference(ids, MAX_TOKENS), f"prompt of {len(ids)} tokens"
