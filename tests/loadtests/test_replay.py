"""loadtests/replay.py: token synthesis, the ideal cached ratio and TBT by hand, then a real replay.

The pure tests pin the arithmetic on hand-made traces; the end-to-end test runs the script as a
user does, against `yutu up` on a tiny checkpoint, and checks what summary.json says.
"""

from __future__ import annotations

import importlib.util
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cli_up import read_until  # tests/ is on sys.path (rootdir conftest, prepend import mode)
from yutu.engine.testing import make_tiny_checkpoint
from yutu.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "loadtests"))

from replay_report import Outcome, RequestRecord, summarize, tbt_ms  # noqa: E402
from replay_trace import (  # noqa: E402
    BlockTokens,
    Synthesis,
    TraceRequest,
    ideal_cached_tokens,
    parse_trace_line,
    plan,
)


def trace_req(line: int, input_length: int, hash_ids: list[int], output_length: int = 64,
              timestamp_ms: float = 0.0) -> TraceRequest:  # fmt: skip
    return TraceRequest(line, timestamp_ms, input_length, output_length, tuple(hash_ids))


def synth(**kw: int | float) -> Synthesis:
    args: dict[str, int | float] = {"vocab_size": 1000, "max_model_len": 4096, "block_tokens": 32}
    return Synthesis(**(args | kw))  # type: ignore[arg-type]


# -- token synthesis -------------------------------------------------------------------------


def test_equal_hash_ids_give_equal_tokens_and_different_ids_differ() -> None:
    s = synth(block_tokens=32, min_token_id=10, vocab_size=1000)
    a, b, c = plan([trace_req(0, 1536, [0, 1, 2]), trace_req(1, 1536, [0, 1, 3]), trace_req(2, 512, [2])], s)
    assert a.prompt[:64] == b.prompt[:64]  # the shared prefix [0, 1] is shared on the wire
    assert a.prompt[64:] != b.prompt[64:]  # blocks 2 and 3 differ
    assert a.prompt[64:] == c.prompt  # a hash id's tokens do not depend on what came before it
    fresh = BlockTokens(s)  # deterministic: a new generator gives the same ids
    assert a.prompt == tuple(np.concatenate([fresh.of(0), fresh.of(1), fresh.of(2)]).tolist())
    assert all(10 <= t < 1000 for t in a.prompt + b.prompt)
    assert BlockTokens(synth(seed=1)).of(0).tolist() != fresh.of(0).tolist()  # the seed matters


def test_lengths_scale_with_block_tokens_and_the_last_block_is_partial() -> None:
    # 1324 trace tokens = 2 full blocks + 300; at 64 tokens a block: ceil(1324 * 64 / 512) = 166
    (req,) = plan([trace_req(0, 1324, [7, 8, 9], output_length=52)], synth(block_tokens=64))
    assert len(req.prompt) == 166 and req.max_tokens == math.ceil(52 / 8) == 7
    assert req.prompt[128:] == tuple(BlockTokens(synth(block_tokens=64)).of(9)[:38].tolist())
    assert (req.prompt_tokens_cut, req.output_tokens_cut) == (0, 0)
    (other,) = plan(
        [trace_req(0, 1324, [7, 8, 9], output_length=52)], synth(block_tokens=64, output_scale=0.5)
    )
    assert other.max_tokens == 26
    (tiny,) = plan([trace_req(0, 10, [5], output_length=0)], synth(block_tokens=64))
    assert len(tiny.prompt) == 2 and tiny.max_tokens == 1  # ceil(10 / 8); at least one output token


def test_prompts_lose_their_tail_to_fit_max_model_len() -> None:
    s = synth(block_tokens=64, max_model_len=100)
    (req,) = plan([trace_req(0, 1324, [7, 8, 9], output_length=52)], s)
    assert len(req.prompt) == 100 - 7 and req.prompt_tokens_cut == 166 - 93 and req.max_tokens == 7
    (full,) = plan([trace_req(0, 1324, [7, 8, 9], output_length=52)], synth(block_tokens=64))
    assert req.prompt == full.prompt[:93]  # the head is kept, block 9 and part of block 8 are cut
    assert req.chain == full.chain[:2]
    (long_out,) = plan([trace_req(0, 1324, [7, 8, 9], output_length=5000)], s)  # 625 tokens alone
    assert (long_out.max_tokens, long_out.output_tokens_cut) == (99, 625 - 99)
    assert len(long_out.prompt) == 1 and long_out.prompt_tokens_cut == 165


def test_arrival_times_scale_and_duration_cuts_the_slice() -> None:
    trace = [trace_req(i, 512, [i], timestamp_ms=1000.0 + 3000 * i) for i in range(5)]
    wire = plan(trace, synth(), time_scale=3, duration_s=2.0)
    assert [w.send_at_s for w in wire] == [0.0, 1.0, 2.0]  # the 4th is due at 3 s


def test_ideal_cached_ratio_on_a_hand_made_trace() -> None:
    # 32 tokens per trace block, KV blocks of 16: the engine reuses whole KV blocks, at most
    # (n - 1) // 16 of them, the longest leading run some earlier request computed.
    trace = [
        trace_req(0, 1024, [0, 1]),  # 64 tokens, nothing before it: 0; computes 4 KV blocks
        trace_req(1, 1536, [0, 1, 2]),  # 96 tokens: blocks 0-3 are r0's, block 4 is new: 64
        trace_req(2, 768, [0, 3]),  # 48 tokens: at most 47 // 16 = 2 blocks, both r0's: 32
        trace_req(3, 1000, [0, 1]),  # 63 tokens (block 1 partial): 62 // 16 = 3 blocks, all seen: 48
        trace_req(4, 1536, [0, 1, 2]),  # 96 tokens, all 6 blocks seen, capped at 95 // 16 = 5: 80
    ]
    wire = plan(trace, synth(block_tokens=32))
    assert [len(w.prompt) for w in wire] == [64, 96, 48, 63, 96]
    assert ideal_cached_tokens(wire, 32, 16) == [0, 64, 32, 48, 80]
    assert sum(ideal_cached_tokens(wire, 32, 16)) / sum(len(w.prompt) for w in wire) == 224 / 367


def test_a_hash_id_after_a_different_prefix_is_not_a_shared_prefix() -> None:
    wire = plan([trace_req(0, 1024, [0, 1]), trace_req(1, 1024, [4, 1]), trace_req(2, 1024, [0, 1])], synth())
    assert ideal_cached_tokens(wire, 32, 16) == [0, 0, 48]


def _ideal_from_tokens(prompts: list[tuple[int, ...]], kb: int) -> list[int]:
    """The plain version: KV blocks keyed by the token prefix itself."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in prompts:
        keys = [p[: (j + 1) * kb] for j in range(len(p) // kb)]
        hits = 0
        for key in keys[: (len(p) - 1) // kb]:
            if key not in seen:
                break
            hits += 1
        out.append(hits * kb)
        seen.update(keys)
    return out


def test_ideal_from_hash_ids_agrees_with_keying_by_tokens() -> None:
    rng = np.random.default_rng(3)
    trace = []
    for i in range(60):  # prefixes drawn from a small tree so they share often; lengths ragged
        n = int(rng.integers(1, 6))
        ids = [int(x) for x in rng.integers(0, 3, size=n)]
        trace.append(trace_req(i, int(rng.integers((n - 1) * 512 + 1, n * 512 + 1)), ids))
    for bt, kb, max_len in ((24, 16, 4096), (32, 16, 100), (16, 16, 4096), (40, 8, 70)):
        wire = plan(trace, synth(block_tokens=bt, max_model_len=max_len))
        ideal = ideal_cached_tokens(wire, bt, kb)
        assert ideal == _ideal_from_tokens([w.prompt for w in wire], kb)
        assert sum(ideal) > 0


def test_a_malformed_trace_line_is_refused_with_its_line_number() -> None:
    with pytest.raises(ValueError, match="trace line 3: input_length 1025 needs 3"):
        parse_trace_line('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}', 2)
    with pytest.raises(ValueError, match="trace line 1 is not a Mooncake record"):
        parse_trace_line('{"timestamp": 0}', 0)


# -- metrics ---------------------------------------------------------------------------------


def test_tbt_is_the_mean_of_the_worst_tenth_of_the_gaps() -> None:
    gaps = [0.010] * 18 + [0.050, 0.090]  # 20 gaps: the worst 2 are 50 and 90 ms
    times = np.cumsum([0.2, *gaps]).tolist()
    assert tbt_ms(times) == pytest.approx(70.0)
    assert tbt_ms([0.0, 0.01, 0.03, 0.04, 0.05, 0.09]) == pytest.approx(40.0)  # 5 gaps: the worst one
    assert tbt_ms([0.2]) is None


def test_a_record_derives_ttft_tpot_and_e2e() -> None:
    rec = RequestRecord(line=0, send_at_s=0.0, prompt_tokens=10, max_tokens=5, ideal_cached_tokens=0,
                        prompt_tokens_cut=0, output_tokens_cut=0, output_tokens=5,
                        chunk_times_s=[0.1, 0.12, 0.14, 0.2, 0.22])  # fmt: skip
    rec.finish_timing(0.5)
    assert (rec.ttft_ms, rec.e2e_ms, rec.chunks) == (pytest.approx(100.0), 500.0, 5)
    assert rec.tpot_ms == pytest.approx((500.0 - 100.0) / 4)
    assert rec.tbt_ms == pytest.approx(60.0)


def test_goodput_counts_requests_meeting_both_slos() -> None:
    def rec(ttft: float, tbt: float | None, outcome: str = Outcome.OK, t: float = 0.0) -> RequestRecord:
        r = RequestRecord(line=0, send_at_s=t, prompt_tokens=100, max_tokens=4, ideal_cached_tokens=32,
                          prompt_tokens_cut=0, output_tokens_cut=0, outcome=outcome, sent_at_s=t,
                          ttft_ms=ttft, tbt_ms=tbt, e2e_ms=1000.0, output_tokens=4,
                          usage_prompt_tokens=100, cached_tokens=16)  # fmt: skip
        return r

    records = [
        rec(500, 50),
        rec(500, None, t=1.0),
        rec(1500, 50),
        rec(500, 150),
        rec(0, None, Outcome.REJECTED),
    ]
    s = summarize(records, {}, {}, slo_ttft_ms=1000, slo_tbt_ms=100)
    assert s.goodput["requests_meeting_slo"] == 2 and s.goodput["share"] == 2 / 5
    assert s.throughput["makespan_s"] == 2.0 and s.goodput["requests_per_s"] == 1.0
    assert s.requests["completed"] == 4 and s.requests["rejected"] == 1
    assert s.cache["cached_ratio"] == 64 / 400 and s.cache["ideal_cached_ratio"] == 160 / 500


# -- end to end ------------------------------------------------------------------------------

SUMMARY_KEYS = {"config", "server", "requests", "errors", "retry_after", "ttft_ms", "tbt_ms", "tpot_ms",
                "e2e_ms", "goodput", "throughput", "cache", "tokens", "instances"}  # fmt: skip


def write_trace(path: Path) -> None:
    """10 requests: 5 early ones, then 5 that share their prefixes, due 5 s later at --time-scale 10.

    At 32 tokens a block: prompts of 64-96 tokens; the last one (5000 tokens: 313 scaled) must
    lose its tail to fit a 256-token context.
    """
    early = [(1024, [0, 1]), (1536, [2, 3, 4]), (1024, [5, 6]), (700, [7, 8]), (1536, [0, 1, 9])]
    late = [(1536, [0, 1, 10]), (1024, [2, 3]), (1536, [5, 6, 11]), (1024, [7, 12]),
            (5000, [0, 1, 9, 13, 14, 15, 16, 17, 18, 19])]  # fmt: skip
    lines = [{"timestamp": 100 * i, "input_length": n, "output_length": 100, "hash_ids": ids}
             for i, (n, ids) in enumerate(early)]  # fmt: skip
    lines += [{"timestamp": 50_000 + 100 * i, "input_length": n, "output_length": 100, "hash_ids": ids}
              for i, (n, ids) in enumerate(late)]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_replay_against_yutu_up(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-replay", arch="llama", seed=7)
    port, redis_port = free_port(), free_port()
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out"
    write_trace(trace)
    stack = subprocess.Popen(
        [sys.executable, "-m", "yutu.cli", "up", "--model", str(checkpoint), "--port", str(port),
         "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--redis-dir", str(tmp_path / "redis"),
         "--log-dir", str(tmp_path / "logs"), "--workers", "1", "--store-nodes", "0", "--kv-cache-memory-mib", "32", "--max-model-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        read_until(stack, "Ctrl-C stops everything", timeout_s=240)
        proc = subprocess.run(
            [sys.executable, str(ROOT / "loadtests" / "replay.py"), str(trace), "--url",
             f"http://127.0.0.1:{port}/v1", "--time-scale", "10", "--block-tokens", "32", "--limit", "10",
             "--request-timeout", "60", "--out", str(out)],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        stack.send_signal(signal.SIGINT)
        try:
            stack.wait(timeout=60)
        finally:
            if stack.poll() is None:
                stack.kill()
                stack.wait()
            assert stack.stdout is not None
            stack.stdout.close()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["server"] == {"model": "tiny-replay", "max_model_len": 256, "vocab_size": 512,
                                 "vocab_source": "/detokenize probe"}  # fmt: skip
    assert summary["requests"] == {"planned": 10, "sent": 10, "completed": 10, "rejected": 0, "error": 0,
                                   "timeout": 0, "deadline": 0, "unsent": 0}  # fmt: skip
    assert summary["errors"] == {} and summary["retry_after"] == {}
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    multi_chunk = sum(r["chunks"] >= 2 for r in records)  # a chunk may carry several tokens' text
    for metric, count in (("ttft_ms", 10), ("tbt_ms", multi_chunk), ("tpot_ms", 10), ("e2e_ms", 10)):
        stat = summary[metric]
        assert stat["count"] == count and 0 < stat["p50"] <= stat["p90"] <= stat["p99"]
    assert [r["line"] for r in records] == list(range(10))
    assert [r["max_tokens"] for r in records] == [7] * 10  # ceil(100 / 16)
    assert [r["prompt_tokens"] for r in records] == [64, 96, 64, 44, 96, 96, 64, 96, 64, 249]
    assert all(r["output_tokens"] == 7 and r["finish_reason"] == "length" for r in records)  # ignore_eos
    assert [r["usage_prompt_tokens"] for r in records] == [r["prompt_tokens"] for r in records]
    assert [r["ideal_cached_tokens"] for r in records] == [0, 0, 0, 0, 64, 64, 48, 64, 32, 96]
    assert all(r["cached_tokens"] <= r["ideal_cached_tokens"] for r in records)  # no cache beats unlimited
    tokens = summary["tokens"]
    assert (tokens["requests_truncated"], tokens["prompt_tokens_cut"]) == (1, 313 - 249)
    cache = summary["cache"]
    assert cache["prompt_tokens"] == 933 and cache["ideal_cached_ratio"] == 368 / 933
    assert 0 < cache["cached_ratio"] <= cache["ideal_cached_ratio"]  # the late requests reuse prefixes
    meeting = [r for r in records if r["ttft_ms"] <= 1000 and (r["tbt_ms"] or 0) <= 100]  # the default SLOs
    assert summary["goodput"]["requests_meeting_slo"] == len(meeting)
    assert summary["goodput"]["share"] == len(meeting) / 10
    assert "TTFT ms" in proc.stdout and "ideal with an unlimited prefix cache: 39.4%" in proc.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("ttft_cdf.png", "tbt_cdf.png", "ttft_over_time.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in (out / "plots_skipped.txt").read_text()
