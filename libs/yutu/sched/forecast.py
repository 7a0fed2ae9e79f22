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

Two judgements are made on that forecast:

- Memory (``free_blocks_at``): the blocks free when the request joins are today's free blocks, plus
  those of running sequences forecast to have left by then, minus those every incoming request still
  there (or still to come) takes.
- Arrival (``with_handoffs``): a request joins when its KV has crossed the network after its prefill
  ends (the transfer model's time for its prompt's blocks), not at the prefill's end itself.
- TBT (``peak_load``): the request is judged on the heaviest batch of its *decode lifetime*, not only
  the one it joins. It decodes from ``start`` for ``max_tokens - 1`` steps of the TBT it would see
  there; every committed placement arriving in that window joins its batch. With every placement
  judged this way, each forecast batch was checked by the last request placed into it: the batch at
  any instant holds only requests whose windows cover it, and the last of them to be placed saw
  all the others.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from yutu.sched.costs import DecodeCostModel
from yutu.sched.prefix import cdiv
from yutu.sched.view import DecodeView, IncomingDecode

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


def peak_load(
    decode: DecodeView,
    start: float,
    max_tokens: int,
    prompt_len: int,
    now: float,
    step_s: float,
    model: DecodeCostModel,
) -> DecodeLoad:
    """The heaviest forecast batch (by the TBT it gives once the request is in it) while a request of
    ``prompt_len`` tokens that joins ``decode`` at ``start`` emits its ``max_tokens - 1`` tokens.

    Load rises only when an incoming request arrives, so the candidates are ``start`` and every
    arrival inside the window ``(start, start + (max_tokens - 1) * tbt)``, ``tbt`` the request's
    predicted TBT at ``start``.
    """
    start = max(start, now)
    best = load_at(decode, start, now, step_s)
    best_tbt = tbt_with(best, prompt_len, model)
    end = start + (max_tokens - 1) * max(_MIN_STEP_S, best_tbt)
    for t in sorted({inc.arrival_s for inc in decode.incoming if start < inc.arrival_s < end}):
        load = load_at(decode, t, now, step_s)
        tbt = tbt_with(load, prompt_len, model)
        if tbt > best_tbt:
            best, best_tbt = load, tbt
    return best


def with_handoffs(decode: DecodeView, handoff_s: Callable[[int], float]) -> DecodeView:
    """``decode`` with each incoming request arriving ``handoff_s(prompt_len)`` after its prefill's end:
    its KV crosses the network before it can join."""
    if not decode.incoming:
        return decode
    moved = tuple(
        IncomingDecode(i.arrival_s + handoff_s(i.prompt_len), i.prompt_len, i.max_tokens)
        for i in decode.incoming
    )
    return dataclasses.replace(decode, incoming=moved)


def free_blocks_at(decode: DecodeView, at: float, now: float, step_s: float, block_size: int) -> int:
    """Free blocks of ``decode`` at ``at >= now`` (may be negative): today's, plus the blocks of running
    sequences forecast to have left by then (what they hold now: ``ceil(kv_tokens / bs)``), minus
    those of every incoming request that has not left by then (``decode_blocks`` of its prompt)."""
    k = max(0, _steps(now, at, step_s))
    freed = sum(cdiv(r.kv_tokens, block_size) for r in decode.running if k >= r.remaining_tokens)
    taken = 0
    for inc in decode.incoming:
        j = _steps(inc.arrival_s, at, step_s)
        if j < inc.max_tokens - 1:  # not arrived yet (j < 0), or still decoding at ``at``
            taken += decode_blocks(inc.prompt_len, block_size)
    return decode.free_blocks + freed - taken


def tbt_with(load: DecodeLoad, prompt_len: int, model: DecodeCostModel) -> float:
    """Predicted TBT once a request of ``prompt_len`` tokens joins a batch carrying ``load``."""
    return model.predict(load.batch_size + 1, load.kv_tokens + prompt_len)


def decode_blocks(prompt_len: int, block_size: int) -> int:
    """Blocks a decode instance needs to take a request: its prompt and the first generated token."""
    return cdiv(prompt_len + 1, block_size)


def tbt_retry_after(
    decode: DecodeView,
    ready_at: float,
    now: float,
    step_s: float,
    prompt_len: int,
    max_tokens: int,
    slo_tbt_s: float,
    model: DecodeCostModel,
) -> float | None:
    """Seconds to delay the request (which would join at ``ready_at``) so the peak load of its delayed
    decode lifetime meets the TBT SLO.

    Load only falls at departures, so the earliest good instant is a departure time; None when no
    forecast instant (the batch emptied included) meets the SLO.
    """
    for t in departures(decode, now, step_s):
        if t <= ready_at:
            continue
        peak = peak_load(decode, t, max_tokens, prompt_len, now, step_s, model)
        if tbt_with(peak, prompt_len, model) <= slo_tbt_s:
            return t - ready_at
    return None
