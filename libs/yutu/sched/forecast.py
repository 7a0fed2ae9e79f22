"""Decode load forecasts: a decode instance's batch at a future instant, and the TBT it would give.

Early rejection judges a request's TBT on the load its decode instance is predicted to carry *when
the request's prefill ends* (Mooncake, arXiv version: prediction-based early rejection), not on the
load of this instant. The forecast, at a time ``at`` with ``step = `` the TBT at today's load:

- a running sequence emits one token per step from ``now``: after ``k = floor((at - now) / step)``
  steps it holds ``kv_tokens + k`` KV tokens, and it has left if ``k >= remaining_tokens``;
- an incoming request joins at its ``arrival_s`` with ``prompt_len`` KV tokens, emits one token per
  step from then, and leaves after ``max_tokens - 1`` of them (prefill emitted the first).

One constant step is an approximation (the step shrinks as the batch empties), and ``remaining`` is an
upper bound (a sequence may stop early): both err toward predicting more load, never less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from yutu.sched.costs import DecodeCostModel
from yutu.sched.prefix import cdiv
from yutu.sched.view import DecodeView

_MIN_STEP_S = 1e-6
_EPS = 1e-9  # so a step boundary computed as 2.9999999 counts as 3 steps


@dataclass(frozen=True)
class DecodeLoad:
    """A decode batch: sequences and their total KV tokens."""

    batch_size: int
    kv_tokens: int


def step_now(decode: DecodeView, model: DecodeCostModel) -> float:
    """Predicted step time at today's load (one sequence at least), the forecast's constant step."""
    return max(_MIN_STEP_S, model.predict(max(1, decode.batch_size), decode.kv_tokens))


def _steps(since: float, at: float, step_s: float) -> int:
    return math.floor((at - since) / step_s + _EPS) if at >= since else -1


def load_at(decode: DecodeView, at: float, now: float, step_s: float) -> DecodeLoad:
    """Predicted batch of ``decode`` at time ``at >= now``, before any new request joins."""
    batch = kv = 0
    k = max(0, _steps(now, at, step_s))
    for r in decode.running:
        if k < r.remaining_tokens:
            batch, kv = batch + 1, kv + r.kv_tokens + k
    for inc in decode.incoming:
        j = _steps(inc.arrival_s, at, step_s)
        if 0 <= j < inc.max_tokens - 1:
            batch, kv = batch + 1, kv + inc.prompt_len + j
    return DecodeLoad(batch, kv)


def departures(decode: DecodeView, now: float, step_s: float) -> list[float]:
    """Predicted times at which sequences leave ``decode``, sorted."""
    times = [now + r.remaining_tokens * step_s for r in decode.running]
    times += [inc.arrival_s + (inc.max_tokens - 1) * step_s for inc in decode.incoming]
    return sorted(times)


def tbt_with(load: DecodeLoad, prompt_len: int, model: DecodeCostModel) -> float:
    """Predicted TBT once a request of ``prompt_len`` tokens joins a batch carrying ``load``."""
    return model.predict(load.batch_size + 1, load.kv_tokens + prompt_len)


def free_blocks_after_incoming(decode: DecodeView, block_size: int) -> int:
    """Free blocks of ``decode`` once its incoming requests have taken theirs (may be negative)."""
    return decode.free_blocks - sum(decode_blocks(inc.prompt_len, block_size) for inc in decode.incoming)


def decode_blocks(prompt_len: int, block_size: int) -> int:
    """Blocks a decode instance needs to take a request: its prompt and the first generated token."""
    return cdiv(prompt_len + 1, block_size)


def tbt_retry_after(
    decode: DecodeView,
    ready_at: float,
    now: float,
    step_s: float,
    prompt_len: int,
    slo_tbt_s: float,
    model: DecodeCostModel,
) -> float | None:
    """Seconds to delay the request so the load at its (delayed) prefill end meets the TBT SLO.

    Load only falls at departures, so the earliest good instant is a departure time; None when no
    forecast instant (the batch emptied included) meets the SLO.
    """
    for t in departures(decode, now, step_s):
        if t > ready_at and tbt_with(load_at(decode, t, now, step_s), prompt_len, model) <= slo_tbt_s:
            return t - ready_at
    return None
