"""Scenario ``threshold`` of bench_disagg: where conditional disaggregation should stop.

When a prompt's uncached remainder is small, shipping it to a prefill instance costs a handoff (the
decode waits for the KV, pulls it, then steps) while prefilling it on the decode costs the running
streams a longer step. The conductor's ``--disagg-threshold`` is that crossover; this probe measures it.

Set-up: ``--prefill 1 --decode 1`` with an admin token, so the threshold is switched at run time
(``PUT /policy``) and both modes run interleaved on the same stack. ``background`` streams decode
long outputs on the decode instance the whole time. Per remainder ``R`` and repetition: a fresh
``prefix``-token prompt S is served first (both instances then hold S, and the store has it once the
write-behind settles), then P = S + R fresh tokens, once with the threshold at 0 (P's R tokens are
prefilled on the prefill instance and handed off) and once at R (the decode prefills them). Measured
per P: TTFT, the time to its second token (T2: the first token a decode step produces, so the
handoff is inside it in the disaggregated mode), and the worst gap of the background streams while P
was being served (the stall a local prefill puts on everyone decoding there).

Checked: P went where the threshold says (``x-yutu-prefill`` is ``none`` exactly in local mode) and
reports ``cached_tokens >= prefix``. Local prefill wins at R when the time it saves P (handoff T2
- local T2) is at least the time it costs the others (``background`` x the extra stall, local -
handoff), with that stall under the TBT SLO; the crossover reported is the largest R up to which it
keeps winning (medians). The batch on the decode matters: more streams, a lower crossover.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
from disagg_probes import Prompts, _block_size, _expect, _store_objects, _written_behind
from disagg_stack import Stack, StackError, StackSpec, wait_for

ADMIN_TOKEN = "bench-threshold"
THRESHOLD_STACK = StackSpec("threshold", prefill=1, decode=1, torch_threads=1, admin_token=ADMIN_TOKEN,
                            prefill_stealing=False)  # fmt: skip
FAR_FUTURE_TOKENS = 3000  # background streams: long enough to outlive a measurement


@dataclass(frozen=True)
class ThresholdConfig:
    remainders: tuple[int, ...] = (16, 32, 64, 128, 256)
    prefix: int = 512
    reps: int = 5
    background: int = 4
    slo_tbt_ms: float = 100.0
    seed: int = 3


class Background:
    """``count`` streams decoding on the stack until stopped; every token's arrival time is kept."""

    def __init__(self, stack: Stack, prompts: Prompts, count: int) -> None:
        self.stack, self.prompts = stack, prompts
        self.arrivals: list[list[float]] = [[] for _ in range(count)]
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        body = {"model": self.stack.model, "max_tokens": FAR_FUTURE_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.Client(base_url=self.stack.url, timeout=120.0) as http:
            while not self._stop.is_set():
                body["prompt"] = self.prompts.fresh(64)
                try:
                    with http.stream("POST", "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            self.errors.append(f"background stream answered {resp.status_code}")
                            return
                        for line in resp.iter_lines():
                            if self._stop.is_set():
                                return
                            if line.startswith("data: {"):
                                self.arrivals[i].append(time.perf_counter())
                except httpx.HTTPError as exc:
                    self.errors.append(f"background stream failed: {exc!r}")
                    return

    def worst_gap_s(self, start: float, end: float) -> float:
        """The longest gap between consecutive tokens of any stream overlapping [start, end]."""
        worst = 0.0
        for times in self.arrivals:
            for a, b in zip(times, times[1:], strict=False):
                if b >= start and a <= end:
                    worst = max(worst, b - a)
        return worst

    def running(self) -> bool:
        now = time.perf_counter()
        return all(times and now - times[-1] < 1.0 for times in self.arrivals)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


class _Idle(Background):
    """No background streams (the warm-up)."""

    def __init__(self) -> None:  # noqa: D107 - nothing started
        self.arrivals, self.errors = [], []


def _set_threshold(stack: Stack, tokens: int) -> None:
    conductor = next(iter(stack.records("conductor").values()))
    url = conductor["endpoints"]["admin"]
    policy = httpx.get(f"{url}/policy", timeout=10.0).json()["policy"]
    resp = httpx.put(f"{url}/policy", json={"policy": policy, "disagg_threshold": tokens},
                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10.0)  # fmt: skip
    if resp.status_code != 200 or resp.json().get("disagg_threshold") != tokens:
        raise StackError(
            f"PUT /policy disagg_threshold={tokens} answered {resp.status_code}: {resp.text[:300]}"
        )


def _one(stack: Stack, prompts: Prompts, bg: Background, cfg: ThresholdConfig, r: int, local: bool,
         block: int) -> dict[str, Any]:  # fmt: skip
    _set_threshold(stack, r if local else 0)
    s = prompts.fresh(cfg.prefix)
    before = _store_objects(stack)
    stack.complete(s, 2)
    wait_for(lambda: _written_behind(stack, before + cfg.prefix // block), 30,
             "S's blocks to be written behind", 0.02)  # fmt: skip
    start = time.perf_counter()
    rep = stack.complete(s + prompts.fresh(r), 4)
    end = start + rep.token_times_s[1]
    mode = "local" if local else "handoff"
    where = f"threshold R={r} {mode}: prefill {rep.prefill}"
    _expect((rep.prefill == "none") == local, f"{where}: not where the threshold sends it")
    _expect(rep.cached_tokens >= cfg.prefix, f"{where}: cached_tokens {rep.cached_tokens} < {cfg.prefix}")
    return {"ttft_s": rep.ttft_s, "t2_s": rep.token_times_s[1], "stall_s": bg.worst_gap_s(start, end)}


def run_threshold(stack: Stack, cfg: ThresholdConfig) -> dict[str, Any]:
    block = _block_size(stack)
    _expect(cfg.prefix % block == 0, f"--threshold-prefix must be a multiple of the block size {block}")
    prompts = Prompts(stack.vocab_size, cfg.seed)
    for local in (False, True):  # warm both paths
        _one(stack, prompts, _Idle(), cfg, cfg.remainders[0], local, block)
    bg = Background(stack, Prompts(stack.vocab_size, cfg.seed + 1), cfg.background)
    try:
        wait_for(bg.running, 60, "the background streams to run", 0.05)
        wait_for(lambda: all(len(t) > 50 for t in bg.arrivals), 60, "50 tokens of every background stream")
        step_s = statistics.median((t[-1] - t[-50]) / 49 for t in bg.arrivals)
        rows = []
        for r in cfg.remainders:
            runs: dict[str, list[dict[str, Any]]] = {"handoff": [], "local": []}
            for _ in range(cfg.reps):
                for local in (False, True):
                    runs["local" if local else "handoff"].append(
                        _one(stack, prompts, bg, cfg, r, local, block)
                    )
            row: dict[str, Any] = {"remainder": r}
            for mode, got in runs.items():
                for what in ("ttft_s", "t2_s", "stall_s"):
                    row[f"{mode}_{what[:-2]}_ms"] = statistics.median(g[what] for g in got) * 1e3
            saved = row["handoff_t2_ms"] - row["local_t2_ms"]
            cost = cfg.background * max(0.0, row["local_stall_ms"] - row["handoff_stall_ms"])
            row["saved_ms"], row["cost_ms"] = saved, cost
            row["local_wins"] = saved >= cost and row["local_stall_ms"] < cfg.slo_tbt_ms
            rows.append(row)
        _expect(not bg.errors, f"background streams: {bg.errors[:3]}")
    finally:
        bg.stop()
    crossover = 0
    for row in rows:  # the largest R up to which local prefill keeps winning
        if not row["local_wins"]:
            break
        crossover = row["remainder"]
    return {"stack": stack.spec.command, "prefix": cfg.prefix, "reps": cfg.reps, "background": cfg.background,
            "slo_tbt_ms": cfg.slo_tbt_ms, "background_step_ms": step_s * 1e3, "rows": rows,
            "crossover": crossover}  # fmt: skip


def format_threshold(res: dict[str, Any], default: int) -> str:
    lines = [f"threshold: {res['stack']} (admin token; the threshold switched per request, interleaved);",
             f"  {res['background']} background streams decoding (step {res['background_step_ms']:.1f} ms); per"
             f" remainder R, {res['reps']} prompts of a {res['prefix']}-token cached prefix + R fresh tokens,"
             " medians (ms)",
             "  T2 = time to the 2nd token (the handoff is inside it); stall = worst background token gap meanwhile",
             f"  saved = handoff T2 - local T2; cost = {res['background']} streams x (local stall - handoff stall)",
             f"  {'R':>5}{'handoff TTFT':>14}{'T2':>8}{'stall':>8}{'local TTFT':>12}{'T2':>8}{'stall':>8}"
             f"{'saved':>8}{'cost':>8}  local wins"]  # fmt: skip
    for r in res["rows"]:
        lines.append(f"  {r['remainder']:>5}{r['handoff_ttft_ms']:>14.1f}{r['handoff_t2_ms']:>8.1f}"
                     f"{r['handoff_stall_ms']:>8.1f}{r['local_ttft_ms']:>12.1f}{r['local_t2_ms']:>8.1f}"
                     f"{r['local_stall_ms']:>8.1f}{r['saved_ms']:>8.1f}{r['cost_ms']:>8.1f}"
                     f"  {'yes' if r['local_wins'] else 'no'}")  # fmt: skip
    lines.append(
        f"  [INFO] crossover (largest R up to which saved >= cost, stall < {res['slo_tbt_ms']:g} ms):"
        f" {res['crossover']} tokens; yutu up's default --disagg-threshold is {default}"
    )
    return "\n".join(lines)
