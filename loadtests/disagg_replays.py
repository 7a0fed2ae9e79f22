"""Scenarios 3 and 4 of bench_disagg (and the saturation sweep): the Mooncake trace replayed.

The slice. The conversation trace's prefix reuse is between turns of one conversation, minutes
apart: a contiguous run of 100-200 requests reuses ~5% of its prompt tokens, against ~37% over
the whole trace. So the slice is *conversation-sampled*: of the requests in the first
``window_s`` seconds of the trace (from ``start``), those whose conversation (the second hash id:
the first is a system prompt every request shares) falls in 1 of ``sample`` buckets, whole
conversations kept. ``sample=1`` is the plain contiguous slice. The slice is written to a file
and replayed by ``loadtests/replay.py`` (``block_tokens`` wire tokens per 512-token trace block,
``time_scale`` compressing time) -- the same slice, same schedule, for every stack compared.

Before each replay, every engine is warmed with unrelated prompts (torch's first steps are slow).
The replay's own seed synthesises the tokens; a stack is fresh for each replay of a comparison.
The disaggregated stacks run without prefill stealing (``--no-prefill-stealing``; ``yutu up``
turns it on): these scenarios measure disaggregation itself, every prefill on a prefill instance.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg_probes import Prompts
from disagg_stack import Stack, StackSpec
from replay import ReplayConfig, replay
from replay_report import Summary
from replay_trace import read_trace

PAPER_ORDER = ("kvcentric", "cache_aware", "least_loaded", "round_robin")  # best (lowest TTFT) first


@dataclass(frozen=True)
class TraceConfig:
    trace: Path
    start: int = 0  # first trace line of the window
    window_s: float = 900.0  # trace seconds the slice is taken from
    sample: int = 8  # keep 1 conversation in this many
    block_tokens: int = 32
    output_scale: float | None = None  # None: block_tokens / 512
    time_scale: float = 12.0
    slo_ttft_ms: float = 1000.0
    slo_tbt_ms: float = 100.0
    seed: int = 0
    policies: tuple[str, ...] = ("round_robin", "least_loaded", "cache_aware", "kvcentric")
    policy_rounds: int = 1
    policy_store_nodes: int | None = None  # None: yutu up's default (one store node); 0: no KV store
    sweep_scales: tuple[float, ...] = (8.0, 12.0, 16.0, 24.0)
    sweep_duration_s: float = 20.0  # replay seconds of each sweep point


def conversation(hash_ids: tuple[int, ...], line: int) -> int:
    """A request's conversation: its second hash id (a one-block prompt is its own)."""
    return hash_ids[1] if len(hash_ids) > 1 else -1 - line


def write_slice(cfg: TraceConfig, path: Path) -> dict[str, Any]:
    """Write the slice (module docstring) to ``path`` as a Mooncake trace; return what it holds."""
    requests = read_trace(cfg.trace, cfg.start, None)
    t0 = requests[0].timestamp_ms if requests else 0.0
    kept = [r for r in requests if r.timestamp_ms - t0 < cfg.window_s * 1000.0
            and (conversation(r.hash_ids, r.line) * 2654435761) % (1 << 32) % cfg.sample == 0]  # fmt: skip
    if not kept:
        raise ValueError(f"the slice of {cfg.trace} is empty: raise --trace-window or lower --trace-sample")
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in kept))  # fmt: skip
    span = (kept[-1].timestamp_ms - kept[0].timestamp_ms) / 1000.0
    return {"path": str(path), "requests": len(kept), "trace_span_s": span,
            "conversations": len({conversation(r.hash_ids, r.line) for r in kept}),
            "lines": [kept[0].line, kept[-1].line]}  # fmt: skip


def warm(stack: Stack, engines: int) -> None:
    """A few unrelated requests, so that every engine has run its first (slow) steps."""
    prompts = Prompts(stack.vocab_size, seed=987_654)
    for _ in range(2 * engines):
        stack.complete(prompts.fresh(768), 8)


def replay_on(stack: Stack, cfg: TraceConfig, trace: Path, time_scale: float, seed: int,
              duration_s: float | None = None) -> Summary:  # fmt: skip
    engines = stack.spec.workers or stack.spec.prefill + stack.spec.decode
    warm(stack, engines)
    return replay(ReplayConfig(trace=trace, url=stack.url, model=stack.model, limit=None, duration_s=duration_s,
                               time_scale=time_scale, block_tokens=cfg.block_tokens, output_scale=cfg.output_scale,
                               seed=seed, slo_ttft_ms=cfg.slo_ttft_ms, slo_tbt_ms=cfg.slo_tbt_ms))  # fmt: skip


def brief(s: Summary) -> dict[str, Any]:
    """What the report compares, from one replay's summary."""
    return {
        "requests": s.requests, "errors": s.errors,
        "ttft_ms": {"mean": s.ttft_ms.mean, "p50": s.ttft_ms.p50, "p99": s.ttft_ms.p99},
        "tbt_ms": {"mean": s.tbt_ms.mean, "p50": s.tbt_ms.p50, "p99": s.tbt_ms.p99},
        "tpot_ms": {"p50": s.tpot_ms.p50, "p99": s.tpot_ms.p99},
        "goodput_rps": s.goodput["requests_per_s"], "goodput_share": s.goodput["share"],
        "completed_rps": s.throughput["completed_per_s"], "output_tps": s.throughput["output_tokens_per_s"],
        "makespan_s": s.throughput["makespan_s"], "cached_ratio": s.cache["cached_ratio"],
        "ideal_cached_ratio": s.cache["ideal_cached_ratio"], "instances": s.instances,
        "offered_rps": s.requests["sent"] / max(1e-9, max((r.sent_at_s or 0.0) for r in s.records)),
    }  # fmt: skip


def problems_of(label: str, b: dict[str, Any]) -> list[str]:
    """Requests that did not complete are the system's problem, reported next to the numbers."""
    req = b["requests"]
    bad = {k: req[k] for k in ("rejected", "error", "timeout", "deadline", "unsent") if req[k]}
    return [f"{label}: {bad} of {req['planned']} requests; errors: {b['errors']}"] if bad else []


RunStack = Callable[[StackSpec], Stack]


def run_trace(cfg: TraceConfig, trace: Path, open_stack: RunStack) -> dict[str, Any]:
    """(a) 1P+1D, 1 torch thread each, and (b) one mixed worker with 2 threads: same slice, same load."""
    specs = {"1P+1D": StackSpec("trace-1p1d", prefill=1, decode=1, torch_threads=1, prefill_stealing=False),
             "mixed": StackSpec("trace-mixed", workers=1, torch_threads=2)}  # fmt: skip
    runs: dict[str, Any] = {}
    for label, spec in specs.items():
        with open_stack(spec) as stack:
            runs[label] = {
                "stack": spec.command,
                **brief(replay_on(stack, cfg, trace, cfg.time_scale, cfg.seed)),
            }
    a, b = runs["1P+1D"], runs["mixed"]
    ratio = a["tbt_ms"]["p99"] / b["tbt_ms"]["p99"] if a["tbt_ms"]["p99"] and b["tbt_ms"]["p99"] else None
    target = {"tbt_p99_ratio": ratio, "need": 0.5, "goodput_ratio": a["goodput_rps"] / b["goodput_rps"]
              if b["goodput_rps"] else None}  # fmt: skip
    target["met"] = ratio is not None and ratio <= 0.5 and a["goodput_rps"] >= b["goodput_rps"]
    return {"runs": runs, "target": target,
            "problems": problems_of("1P+1D", a) + problems_of("mixed", b)}  # fmt: skip


def _v(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _table(runs: dict[str, Any]) -> list[str]:
    lines = [f"  {'':<14}{'TTFT p50':>9}{'mean':>8}{'p99':>8}{'TBT p50':>9}{'p99':>8}{'goodput':>9}{'share':>7}"
             f"{'done/s':>8}{'tok/s':>7}{'cached':>8}{'ideal':>7}{'ok':>6}"]  # fmt: skip
    for label, r in runs.items():
        t, b, req = r["ttft_ms"], r["tbt_ms"], r["requests"]
        lines.append(f"  {label:<14}{_v(t['p50']):>9}{_v(t['mean']):>8}{_v(t['p99']):>8}{_v(b['p50']):>9}"
                     f"{_v(b['p99']):>8}{r['goodput_rps']:>9.3f}{r['goodput_share']:>7.0%}{r['completed_rps']:>8.2f}"
                     f"{r['output_tps']:>7.0f}{r['cached_ratio']:>8.1%}{r['ideal_cached_ratio']:>7.1%}"
                     f"{req['completed']:>3}/{req['planned']:<3}")  # fmt: skip
    return lines


def format_trace(res: dict[str, Any], head: str) -> str:
    lines = [head, *(f"  {k}: {r['stack']}" for k, r in res["runs"].items()),
             "  (ms; goodput: requests/s meeting both SLOs; share: of those sent; cached: prompt tokens reused)",
             *_table(res["runs"])]  # fmt: skip
    t = res["target"]
    lines.append(f"  [{'PASS' if t['met'] else 'MISS'}] TBT p99 (1P+1D) / (mixed) <= {t['need']} with goodput not "
                 f"lower: {_v(t['tbt_p99_ratio'], '.2f')}, goodput ratio {_v(t['goodput_ratio'], '.2f')}")  # fmt: skip
    lines += [f"  PROBLEM: {p}" for p in res["problems"]]
    return "\n".join(lines)


def run_policies(cfg: TraceConfig, trace: Path, open_stack: RunStack) -> dict[str, Any]:
    """2P+2D (1 torch thread per engine: 4 engines on 2 cores, oversubscribed) under each policy,
    ``policy_rounds`` times, the rounds interleaved (every policy once, then again): a fresh stack per
    run. The orderings use each policy's median over the rounds."""
    runs: dict[str, Any] = {}
    for round_ in range(1, cfg.policy_rounds + 1):
        for policy in cfg.policies:
            spec = StackSpec(f"policy-{policy}-{round_}", prefill=2, decode=2, torch_threads=1, policy=policy,
                             store_nodes=cfg.policy_store_nodes, prefill_stealing=False)  # fmt: skip
            label = policy if cfg.policy_rounds == 1 else f"{policy} #{round_}"
            with open_stack(spec) as stack:
                s = replay_on(stack, cfg, trace, cfg.time_scale, cfg.seed)
            runs[label] = {"stack": spec.command, "policy": policy, **brief(s)}
    ttft = {p: {k: statistics.median(r["ttft_ms"][k] or math.inf for r in runs.values() if r["policy"] == p)
                for k in ("mean", "p99")} for p in cfg.policies}  # fmt: skip
    by_mean = sorted(ttft, key=lambda p: ttft[p]["mean"])
    by_p99 = sorted(ttft, key=lambda p: ttft[p]["p99"])
    paper = [p for p in PAPER_ORDER if p in ttft]
    return {"runs": runs, "rounds": cfg.policy_rounds, "ttft_ms": ttft, "order_by_mean_ttft": by_mean,
            "order_by_p99_ttft": by_p99, "paper_order": paper, "matches_paper": by_mean == paper,
            "problems": [p for label, r in runs.items() for p in problems_of(label, r)]}  # fmt: skip


def format_policies(res: dict[str, Any], head: str) -> str:
    runs, ttft = res["runs"], res["ttft_ms"]
    over = "" if res["rounds"] == 1 else f" (median of {res['rounds']} rounds)"
    lines = [head, f"  {next(iter(runs.values()))['stack'].rsplit(' --policy', 1)[0]} --policy P",
             "  (4 engines with 1 torch thread each on 2 cores: oversubscribed)", *_table(runs),
             f"  by mean TTFT{over}: " + " <= ".join(f"{p} ({ttft[p]['mean']:.0f})" for p in res["order_by_mean_ttft"]),
             f"  by p99 TTFT{over}:  " + " <= ".join(f"{p} ({ttft[p]['p99']:.0f})" for p in res["order_by_p99_ttft"]),
             f"  paper's order: {' <= '.join(res['paper_order'])}: "
             f"{'matches' if res['matches_paper'] else 'does not match'} (by mean TTFT)"]  # fmt: skip
    lines += [f"  PROBLEM: {p}" for p in res["problems"]]
    return "\n".join(lines)


def run_sweep(cfg: TraceConfig, trace: Path, open_stack: RunStack) -> dict[str, Any]:
    """The trace stacks at each of ``sweep_scales`` (the first ``sweep_duration_s`` of the replay):
    where completed requests stop following the offered rate and TTFT climbs is saturation."""
    specs = {"1P+1D": StackSpec("sweep-1p1d", prefill=1, decode=1, torch_threads=1, prefill_stealing=False),
             "mixed": StackSpec("sweep-mixed", workers=1, torch_threads=2)}  # fmt: skip
    points: dict[str, Any] = {}
    for label, spec in specs.items():
        with open_stack(spec) as stack:
            for i, scale in enumerate(cfg.sweep_scales):
                started = time.monotonic()
                s = replay_on(stack, cfg, trace, scale, cfg.seed + 1000 + i, cfg.sweep_duration_s)
                points[f"{label} x{scale:g}"] = {"stack": spec.command, "scale": scale, **brief(s),
                                                 "wall_s": time.monotonic() - started}  # fmt: skip
    return {"runs": points, "problems": [p for label, r in points.items() for p in problems_of(label, r)]}


def format_sweep(res: dict[str, Any], head: str) -> str:
    lines = [head, "  offered/s: requests sent per second of the schedule", *_table(res["runs"])]
    lines += [f"  {label:<14}offered {r['offered_rps']:.2f}/s" for label, r in res["runs"].items()]
    lines += [f"  PROBLEM: {p}" for p in res["problems"]]
    return "\n".join(lines)
