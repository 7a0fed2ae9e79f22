"""Scenarios 1 and 2 of bench_disagg: single requests, one at a time, on a 2P+1D round_robin stack.

store-hit. Per prompt length L and repetition: request A (fresh random token ids, so nothing is
cached), then B = A's first L-16 tokens + 16 fresh ones. round_robin sends B to the *other*
prefill instance, which cannot have A's KV locally: it fetches the first (L-16)/16 blocks from the
KV store, where A's prefill instance wrote them behind A. Before B is sent, the bench polls the
store master's ``/stats`` every 20 ms until it holds A's L/16 new objects and no engine has a
write in flight. Checked on every B: ``x-yutu-prefill`` differs from A's, ``cached_tokens >= L-16``,
and that instance's ``imports.fetched_blocks`` grew by at least (L-16)/16.

handoff. Per length, cold requests of ``handoff_tokens`` tokens. Per request, the gateway's
``yutu_gateway_handoff_seconds`` (the prefill's first token received -> the decode's first delta:
the KV pull, the release of the hold and one decode step) from the change of its ``_sum`` and
``_count`` around the request (requests run one at a time, so that is exactly this request's), next
to the client's token 1 -> token 2 gap and the decode step (median gap between later tokens).
Checked: one handoff observed, the decode pulled ceil(L/16) blocks. Then the transfer engine
alone moves the same bytes between two processes (:mod:`disagg_transfer`).

A broken promise raises :class:`StackError` saying which, on which request: the bench reports it.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

from disagg_stack import Reply, Stack, StackError, wait_for
from disagg_transfer import measure_pulls

HANDOFF_METRIC = "yutu_gateway_handoff_seconds"


@dataclass(frozen=True)
class ProbeConfig:
    lengths: tuple[int, ...] = (512, 1024, 2048)
    reps: int = 5
    max_tokens: int = 4  # store-hit
    handoff_tokens: int = 8
    transfer_repeat: int = 15
    seed: int = 0


class Prompts:
    """Fresh random token ids: never equal to an earlier prompt (ids from ``min_id`` up)."""

    def __init__(self, vocab: int, seed: int, min_id: int = 10) -> None:
        self.rng = random.Random(seed)
        self.vocab, self.min_id = vocab, min_id

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(self.min_id, self.vocab) for _ in range(n)]


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise StackError(what)


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _block_size(stack: Stack) -> int:
    sizes = {r["meta"]["block_size"] for k in ("prefill", "decode") for r in stack.records(k).values()}
    _expect(len(sizes) == 1, f"engines disagree on block_size: {sizes}")
    return int(sizes.pop())


def _engine_info(stack: Stack) -> dict[str, dict[str, Any]]:
    return {i: stack.admin_json(kind, i, "/info") for i, kind in stack.engine_instances().items()}


def _store_objects(stack: Stack) -> int:
    return int(stack.admin_json("store-master", "store-master", "/stats")["objects"])


def _written_behind(stack: Stack, objects: int) -> bool:
    if _store_objects(stack) < objects:
        return False
    return all((i.get("write_behind") or {}).get("in_flight", 0) == 0 for i in _engine_info(stack).values())


def _fetched(stack: Stack) -> dict[str, int]:
    return {i: int(info["imports"]["fetched_blocks"]) for i, info in _engine_info(stack).items()}


# -- store-hit ------------------------------------------------------------------------------------


def _hit_pair(stack: Stack, prompts: Prompts, length: int, block: int, max_tokens: int) -> dict[str, Any]:
    """One cold request A and its store hit B; the checks of the module docstring."""
    a = prompts.fresh(length)
    before = _store_objects(stack)
    ra = stack.complete(a, max_tokens)
    _expect(
        ra.cached_tokens == 0,
        f"cold request of {length} fresh tokens reports cached_tokens={ra.cached_tokens}",
    )
    waited = wait_for(lambda: _written_behind(stack, before + length // block), 30,
                      f"A's {length // block} blocks to be written behind into the store", 0.02)  # fmt: skip
    fetched = _fetched(stack)
    rb = stack.complete(a[: length - block] + prompts.fresh(block), max_tokens)
    where = f"store-hit L={length}: A on {ra.prefill}, B on {rb.prefill}"
    _expect(
        rb.prefill not in (None, "none", ra.prefill), f"{where}: B must run on the other prefill instance"
    )
    assert rb.prefill is not None
    _expect(
        rb.cached_tokens >= length - block,
        f"{where}: B's cached_tokens {rb.cached_tokens} < {length - block}",
    )
    grew = _fetched(stack)[rb.prefill] - fetched[rb.prefill]
    _expect(grew >= (length - block) // block,
            f"{where}: {rb.prefill} fetched {grew} blocks from the store, expected >= {(length - block) // block}")  # fmt: skip
    return {"cold_ttft_s": ra.ttft_s, "hit_ttft_s": rb.ttft_s, "cold_prefill": ra.prefill,
            "hit_prefill": rb.prefill, "hit_cached_tokens": rb.cached_tokens, "fetched_blocks": grew,
            "write_behind_wait_s": waited}  # fmt: skip


def run_store_hit(stack: Stack, cfg: ProbeConfig) -> dict[str, Any]:
    block, prompts = _block_size(stack), Prompts(stack.vocab_size, cfg.seed)
    for length in cfg.lengths:  # warm both prefill instances (round_robin) and the decode
        for _ in range(2):
            stack.complete(prompts.fresh(length), cfg.max_tokens)
    rows: list[dict[str, Any]] = []
    for length in cfg.lengths:
        pairs = [_hit_pair(stack, prompts, length, block, cfg.max_tokens) for _ in range(cfg.reps)]
        cold, hit = _ms([p["cold_ttft_s"] for p in pairs]), _ms([p["hit_ttft_s"] for p in pairs])
        rows.append({"length": length, "reps": cfg.reps, "cold_ttft_ms": cold, "hit_ttft_ms": hit,
                     "ratio": hit / cold, "min_cached_tokens": min(p["hit_cached_tokens"] for p in pairs),
                     "pairs": pairs})  # fmt: skip
    last = rows[-1]
    target = {"length": last["length"], "need": 0.5, "ratio": last["ratio"], "met": last["ratio"] <= 0.5}
    return {"stack": stack.spec.command, "block_size": block, "max_tokens": cfg.max_tokens, "rows": rows,
            "target": target}  # fmt: skip


def format_store_hit(res: dict[str, Any]) -> str:
    lines = [f"store-hit: {res['stack']}",
             f"  TTFT, median of {res['rows'][0]['reps']} pairs (fresh prompts each), max_tokens "
             f"{res['max_tokens']}, greedy, ignore_eos; B = A's first L-{res['block_size']} tokens + "
             f"{res['block_size']} new, on the other prefill instance",
             f"  {'L':>6}{'cold ms':>10}{'hit ms':>10}{'hit/cold':>10}{'min cached':>12}{'wb wait ms':>12}"]  # fmt: skip
    for r in res["rows"]:
        wait = _ms([p["write_behind_wait_s"] for p in r["pairs"]])
        lines.append(f"  {r['length']:>6}{r['cold_ttft_ms']:>10.1f}{r['hit_ttft_ms']:>10.1f}{r['ratio']:>10.2f}"
                     f"{r['min_cached_tokens']:>12}{wait:>12.0f}")  # fmt: skip
    t = res["target"]
    lines.append(
        f"  [{'PASS' if t['met'] else 'MISS'}] hit <= {t['need']}x cold at {t['length']}: {t['ratio']:.2f}x"
    )
    return "\n".join(lines)


# -- handoff --------------------------------------------------------------------------------------


def _handoff_once(stack: Stack, prompts: Prompts, length: int, blocks: int, tokens: int,
                  metric: bool) -> dict[str, Any]:  # fmt: skip
    """One cold request of ``length`` tokens whose KV is ``blocks`` blocks; its handoff timings."""
    s0, c0 = (
        (stack.metric(f"{HANDOFF_METRIC}_sum"), stack.metric(f"{HANDOFF_METRIC}_count")) if metric else (0, 0)
    )
    decodes = {i: k for i, k in stack.engine_instances().items() if k == "decode"}
    pulled0 = {i: stack.admin_json(k, i, "/info")["imports"]["pulled_blocks"] for i, k in decodes.items()}
    rep: Reply = stack.complete(prompts.fresh(length), tokens)
    where = f"handoff L={length} ({rep.prefill} -> {rep.decode})"
    _expect(rep.prefill not in (None, "none"), f"{where}: the request was not disaggregated")
    assert rep.decode is not None
    pulled = stack.admin_json("decode", rep.decode, "/info")["imports"]["pulled_blocks"] - pulled0[rep.decode]
    _expect(pulled == blocks, f"{where}: the decode pulled {pulled} blocks, expected {blocks}")
    out = {"client_s": rep.token_times_s[1] - rep.token_times_s[0],
           "step_s": statistics.median(b - a for a, b in zip(rep.token_times_s[1:], rep.token_times_s[2:], strict=False)),
           "ttft_s": rep.ttft_s, "pulled_blocks": pulled}  # fmt: skip
    if metric:
        count = stack.metric(f"{HANDOFF_METRIC}_count") - c0
        _expect(count == 1, f"{where}: the gateway observed {count:g} handoffs for one request")
        out["gateway_s"] = stack.metric(f"{HANDOFF_METRIC}_sum") - s0
    return out


def run_handoff(stack: Stack, cfg: ProbeConfig) -> dict[str, Any]:
    _expect(cfg.handoff_tokens >= 3, "handoff needs at least 3 tokens (token 1 -> 2 and a decode step)")
    block = _block_size(stack)
    prompts, block_bytes = Prompts(stack.vocab_size, cfg.seed + 1), stack.block_bytes()
    metric = stack.has_metric(HANDOFF_METRIC)
    for length in cfg.lengths:
        stack.complete(prompts.fresh(length), cfg.handoff_tokens)
    rows: list[dict[str, Any]] = []
    for length in cfg.lengths:
        blocks = math.ceil(length / block)
        runs = [
            _handoff_once(stack, prompts, length, blocks, cfg.handoff_tokens, metric) for _ in range(cfg.reps)
        ]
        rows.append({"length": length, "blocks": blocks, "bytes": blocks * block_bytes,
                     "gateway_ms": _ms([r["gateway_s"] for r in runs]) if metric else None,
                     "client_ms": _ms([r["client_s"] for r in runs]), "step_ms": _ms([r["step_s"] for r in runs]),
                     "runs": runs})  # fmt: skip
    raw = measure_pulls(stack.redis_url, block_bytes, [r["blocks"] for r in rows], cfg.transfer_repeat)
    for r in rows:
        r["raw"] = {shape: by_count[r["blocks"]] for shape, by_count in raw.items()}
        handoff = r["gateway_ms"] if metric else r["client_ms"]
        r["handoff_ms"], r["over_step_ms"] = handoff, handoff - r["step_ms"]
        r["handoff_per_raw_shm"] = handoff / r["raw"]["shm_contiguous"]["p50_ms"]
    return {"stack": stack.spec.command, "source": "gateway metric" if metric else "client timing",
            "block_bytes": block_bytes, "tokens": cfg.handoff_tokens, "reps": cfg.reps,
            "transfer_repeat": cfg.transfer_repeat, "rows": rows}  # fmt: skip


def format_handoff(res: dict[str, Any]) -> str:
    gateway = res["source"] == "gateway metric"
    lines = [f"handoff: {res['stack']}; {res['reps']} cold requests of {res['tokens']} tokens per length, medians",
             f"  handoff = {HANDOFF_METRIC} per request (prefill's first token received -> decode's first delta)"
             if gateway else "  handoff = client token 1 -> token 2 (the gateway has no handoff metric)",
             "  step = the decode's step (median gap between later tokens); transfer engine alone, same bytes,",
             "  between two processes (median of "
             f"{res['transfer_repeat']}): SHM one request (what the stack uses on one host), SHM one request",
             "  per block (fragmented caches), TCP one request (two hosts)",
             f"  {'L':>5}{'blocks':>7}{'KiB':>7}{'handoff':>9}{'client':>8}{'step':>7}{'h-step':>8}"
             f"{'shm':>8}{'shm/blk':>9}{'tcp':>8}{'handoff/shm':>13}   (ms)"]  # fmt: skip
    for r in res["rows"]:
        raw = r["raw"]
        lines.append(f"  {r['length']:>5}{r['blocks']:>7}{r['bytes'] // 1024:>7}{r['handoff_ms']:>9.2f}"
                     f"{r['client_ms']:>8.2f}{r['step_ms']:>7.2f}{r['over_step_ms']:>8.2f}"
                     f"{raw['shm_contiguous']['p50_ms']:>8.3f}{raw['shm_per_block']['p50_ms']:>9.3f}"
                     f"{raw['tcp_contiguous']['p50_ms']:>8.3f}{r['handoff_per_raw_shm']:>12.0f}x")  # fmt: skip
    return "\n".join(lines)
