"""Failures on the disaggregated path: every path frees its blocks and holds, and nothing hangs.

- a decode instance SIGKILLed mid-stream: the request moves to another decode instance with the
  tokens streamed so far, and the client's stream goes on with no token duplicated or missing --
  also when it was the only one, and the stream waits for it to be started again;
- a prefill instance SIGKILLed or frozen: its requests are placed again on another one;
- a gateway SIGKILLed while its prefill runs: the prefill's KV hold, which nobody can pull, goes;
- the conductor SIGKILLed: the gateway places requests itself meanwhile, and a restarted conductor
  rebuilds its view (instances, their prefix caches, the store's blocks) from the registry and
  KV-event replays.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.disagg.disagg_support import MODEL_NAME, DisaggStack, prompt


def stream_and_kill(
    stack: DisaggStack, ids: list[int], max_tokens: int, after: int, then: Any = None
) -> tuple[list[int], str]:
    """Stream a greedy completion; after ``after`` tokens, SIGKILL the decode instance serving it
    (and call ``then(name)`` on it, while the stream goes on being read)."""
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
    tokens: list[int] = []
    killed = ""
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                lp = choice.get("logprobs")
                if lp:
                    tokens += [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
            if not killed and len(tokens) >= after:
                killed = resp.headers["x-yutu-decode"]
                stack.kill(killed)
                if then is not None:
                    then(killed)
    return tokens, killed


def test_a_decode_killed_mid_stream_hands_the_request_to_another(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    with DisaggStack(tmp_path, long_model, redis_url, prefill=1, decode=2) as s:
        ids = prompt(100, seed=21)
        tokens, killed = stream_and_kill(s, ids, max_tokens=1200, after=150)
        assert killed in ("decode-0", "decode-1")
        assert len(tokens) == 1200
        assert tokens == s.reference(ids, 1200)  # the stream went on: nothing repeated, nothing lost
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert 'yutu_gateway_migrations_total{model="tiny"} 1.0' in metrics
        survivor = "decode-1" if killed == "decode-0" else "decode-0"
        info = s.get("decode", survivor, "/info")
        # It took the prompt's and the generated blocks from the store, and computed only the rest.
        assert info["imports"]["fetched_blocks"] > 100 // 16


def test_the_only_decode_killed_mid_stream_takes_the_request_back_when_it_is_started_again(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    """yutu up's default shape (one decode instance): killed mid-stream, its streams wait for it
    (--failover-wait) while it is started again (as yutu up's supervisor does), then go on. (Started
    from this thread: a child started from a pool's thread gets SIGTERM when that thread ends.)"""
    with DisaggStack(tmp_path, long_model, redis_url, prefill=1, decode=1) as s:
        ids = prompt(100, seed=22)
        tokens, killed = stream_and_kill(s, ids, max_tokens=600, after=150, then=s.restart)
        assert killed == "decode-0"
        assert tokens == s.reference(ids, 600)  # the stream waited, then went on: nothing repeated or lost
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert 'yutu_gateway_migrations_total{model="tiny"} 1.0' in metrics


def test_prefill_instances_killed_or_frozen_have_their_requests_placed_again(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    with DisaggStack(tmp_path, long_model, redis_url, prefill=2, decode=1, policy="round_robin") as s:
        prompts = [prompt(200 + i, seed=40 + i) for i in range(4)]
        s.kill("prefill-0", signal.SIGSTOP)  # frozen: its connection stays up
        try:
            started = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(lambda ids: s.complete(ids, max_tokens=6), prompts))
            assert all(r.status == 200 for r in replies), [r.body for r in replies]
            assert {r.headers["x-yutu-prefill"] for r in replies} == {"prefill-1"}
            assert time.monotonic() - started < 20  # the liveness window (3 s), not a hang
            for ids, r in zip(prompts, replies, strict=True):
                assert r.tokens == s.reference(ids, 6)
        finally:
            s.kill("prefill-0", signal.SIGCONT)
        # Woken up, prefill-0 drops what it was asked for while frozen (the gateway released it).
        s.wait_for(
            lambda: s.get("prefill", "prefill-0", "/info")["in_flight"] == 0, 40, "prefill-0 to drop its work"
        )
        # The decode instance, told of those requests while prefill-0 held them, dropped them (their
        # blocks freed: the stack's closing check) and took them again for prefill-1's attempt.
        imports = s.get("decode", "decode-0", "/info")["imports"]
        assert imports["awaits_dropped"] >= 1 and imports["awaited"] == 4 + imports["awaits_dropped"]
        # prefill-1's holds of the requests placed again went when the decode pulled them, though
        # the decode ran those under other ids (<id>-p1): a handle names its hold (not the lease,
        # 30 s here, ending them).
        s.wait_for(
            lambda: s.get("prefill", "prefill-1", "/info")["holds"]["held"] == 0,
            10,
            "prefill-1's holds to go",
        )
        assert s.get("prefill", "prefill-1", "/info")["holds"]["expired"] == 0

        s.kill("prefill-1")  # and now outright: its requests go to prefill-0
        replies = [s.complete(ids, max_tokens=6) for ids in prompts]
        assert all(r.status == 200 for r in replies), [r.body for r in replies]
        assert {r.headers["x-yutu-prefill"] for r in replies} <= {"prefill-0", "none"}
        for ids, r in zip(prompts, replies, strict=True):
            assert r.tokens == s.reference(ids, 6)


def test_a_gateway_killed_while_its_prefill_runs_leaves_no_kv_hold(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    """The prefill's result cannot be sent (the gateway's connection is gone), so nobody can pull
    its KV: the hold goes at once, not when its lease (30 s) ends. The decode instance told of the
    request drops it too (its front end is gone): the stack's closing check finds every block free."""
    with DisaggStack(tmp_path, long_model, redis_url, prefill=1, decode=1) as s:

        def prefill_calls() -> int:
            return sum(p["in_flight"] for p in httpx.get(f"{s.url}/info", timeout=5).json()["prefill"])

        s.kill("prefill-0", signal.SIGSTOP)  # the request waits in its socket while the gateway dies
        try:
            with ThreadPoolExecutor(1) as pool:
                request = pool.submit(s.complete, prompt(300, seed=90), 4)
                s.wait_for(lambda: prefill_calls() == 1, 20, "the prefill call to be sent")
                s.kill("gateway")
                with pytest.raises(httpx.HTTPError):
                    request.result(30)
        finally:
            s.kill("prefill-0", signal.SIGCONT)
        s.wait_for(
            lambda: s.get("prefill", "prefill-0", "/info")["holds"]["undelivered"] == 1,
            10,
            "the undeliverable result's hold to go",
        )
        info = s.get("prefill", "prefill-0", "/info")
        assert info["holds"] == {"held": 0, "released": 0, "expired": 0, "undelivered": 1}
        assert info["in_flight"] == 0 and info["engine"]["generation_tokens_total"] == 1  # it was prefilled


def view_of(s: DisaggStack) -> dict[str, Any]:
    instances = s.get("conductor", "conductor", "/instances")
    return {
        "instances": {i["instance_id"]: i["cached_blocks"] for i in instances["instances"] if i["live"]},
        "store_blocks": instances["store_blocks"],
    }


def truth_of(s: DisaggStack) -> dict[str, Any]:
    """What the conductor's view should say: each instance's own count, the store master's."""
    names = [n for n in s.specs if n.startswith(("prefill-", "decode-"))]
    stats = httpx.get(s.admin("store-master", "store-master") + "/stats", timeout=10).json()
    return {
        "instances": {n: s.get(n.split("-")[0], n, "/info")["cached_blocks"] for n in names},
        "store_blocks": stats["objects"],
    }


def test_a_restarted_conductor_rebuilds_its_view_and_serving_never_stops(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    with DisaggStack(tmp_path, long_model, redis_url, prefill=1, decode=1) as s:
        for i in range(3):
            assert s.complete(prompt(300, seed=60 + i), max_tokens=4).status == 200
        s.wait_for(lambda: view_of(s) == truth_of(s), 20, "the conductor's view to settle")
        before = view_of(s)
        assert before["store_blocks"] > 0 and all(before["instances"].values())

        s.kill("conductor")
        served = [s.complete(prompt(300, seed=70 + i), max_tokens=4) for i in range(3)]
        assert all(r.status == 200 for r in served), [r.body for r in served]
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert 'yutu_gateway_conductor_fallbacks_total{model="tiny"} 3.0' in metrics

        s.restart("conductor")
        s.wait_for(s._conductor_sees_everyone, 30, "the restarted conductor to see every instance")
        s.wait_for(
            lambda: view_of(s) == truth_of(s), 20, "the rebuilt view to match the instances and the store"
        )
        after = view_of(s)
        assert after["store_blocks"] >= before["store_blocks"] and after == truth_of(s)
        assert s.complete(prompt(300, seed=80), max_tokens=4).status == 200
        recent = s.get("conductor", "conductor", "/placements/recent")["placements"]
        assert recent and recent[0]["policy"] == "kvcentric"
