"""The placement steps every policy shares; a policy only says which prefill and which decode it prefers.

``Placer.place(view, request, now)``, in order:

1. No decode instance live: Rejection NO_DECODE (503).
2. Decode capacity: drop decode instances without ``ceil((L + 1) / bs)`` free blocks after their
   incoming requests take theirs; none left: Rejection NO_CAPACITY -- with an SLO set. Without one,
   nothing is turned away: the request goes where it would wait least (it queues there).
3. Prefill: estimate every prefill instance (prefix plan with fetch-or-recompute, queue, TTFT:
   ``yutu.sched.estimate``), drop those without free blocks for the blocks they would allocate, and
   let the policy choose (``choose_prefill``). None live or none with room: the decode prefills.
4. Decode: forecast each remaining decode's batch at the prefill's end (``yutu.sched.forecast``),
   drop those whose batch would be full, and let the policy choose (``choose_decode``).
5. Conditional disaggregation: when at most ``disagg_threshold`` prompt tokens remain uncached after
   the chosen decode's own cache and the store, that decode prefills them itself.
6. Early rejection: a predicted TTFT above ``slo_ttft_s`` or TBT (on the forecast load, the request
   included) above ``slo_tbt_s`` rejects the request with a ``retry_after_s`` estimate -- once the
   cost model behind the prediction is calibrated (measured, or a trusted prior).

Candidates reach the policy sorted by instance id, so the outcome never depends on snapshot order.
Deterministic: the same policy state, view, request and ``now`` give the same answer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from yutu.sched.costs import CostModels
from yutu.sched.estimate import Estimate, estimate, prefill_blocks, queue_time, uncached_tokens
from yutu.sched.forecast import (
    DecodeLoad,
    decode_blocks,
    departures,
    free_blocks_after_incoming,
    load_at,
    step_now,
    tbt_retry_after,
    tbt_with,
)
from yutu.sched.options import PolicyOptions
from yutu.sched.outcome import RETRY_MAX_S, Placement, RejectCause, Rejection, clamp_retry
from yutu.sched.view import ClusterView, DecodeView, RequestView

NO_DECODE_RETRY_S = 5.0  # a replacement decode instance registers within seconds


@dataclass(frozen=True)
class DecodeCandidate:
    """A decode instance as the policy weighs it: its load when the request's prefill ends."""

    view: DecodeView
    ready_at_s: float  # when the request's prefill is predicted to end
    load: DecodeLoad  # forecast batch at ready_at_s, before the request joins
    tbt_s: float  # predicted TBT once the request joins
    step_s: float  # the step time at today's load the forecast used
    local: Estimate | None = None  # set when this decode prefills the request itself

    @property
    def instance_id(self) -> str:
        return self.view.instance_id


class Policy(Protocol):
    """What the conductor and the simulator call: one placement per request, ``now`` passed in."""

    @property
    def name(self) -> str: ...

    def place(self, view: ClusterView, request: RequestView, now: float) -> Placement | Rejection: ...


class Placer(ABC):
    """Base of every policy: the shared steps (module docstring) around two choices."""

    name: ClassVar[str]

    def __init__(self, options: PolicyOptions | None = None, costs: CostModels | None = None) -> None:
        self.options = options if options is not None else PolicyOptions()
        self.costs = costs if costs is not None else CostModels()

    @abstractmethod
    def choose_prefill(self, candidates: Sequence[Estimate]) -> Estimate:
        """Pick one of ``candidates`` (non-empty, sorted by instance id)."""

    @abstractmethod
    def choose_decode(self, candidates: Sequence[DecodeCandidate]) -> DecodeCandidate:
        """Pick one of ``candidates`` (non-empty, sorted by instance id)."""

    def place(self, view: ClusterView, request: RequestView, now: float) -> Placement | Rejection:
        """Place ``request`` on ``view`` at time ``now``: a Placement, or a Rejection saying why not."""
        if not math.isfinite(now):
            raise ValueError(f"now must be a finite time in seconds, got {now!r}")
        view.check_request(request)
        if not view.decodes:
            return self._reject(
                request, RejectCause.NO_DECODE, "no decode instance is live", NO_DECODE_RETRY_S
            )
        need = decode_blocks(request.prompt_len, view.block_size)
        roomy = [d for d in _by_id(view.decodes) if free_blocks_after_incoming(d, view.block_size) >= need]
        queue_when_full = self.options.slo_ttft_s is None and self.options.slo_tbt_s is None
        if not roomy and queue_when_full:
            roomy = _by_id(view.decodes)  # every one is full: wait on one rather than refuse
        if not roomy:
            most = max(free_blocks_after_incoming(d, view.block_size) for d in view.decodes)
            return self._reject(
                request,
                RejectCause.NO_CAPACITY,
                f"no decode instance has {need} free KV blocks for a {request.prompt_len}-token prompt "
                f"(most free: {most})",
                self._next_departure(view.decodes, now, now),
            )
        prefill, note = self._choose_prefill(view, request)
        if prefill is None:
            cands = [c for d in roomy if (c := self._local(view, request, d, now)) is not None]
        else:
            ready = now + prefill.ttft_s
            cands = [
                c for d in roomy if (c := self._candidate(d, ready, now, request.prompt_len)) is not None
            ]
        if not cands and queue_when_full:  # every batch is full: join the queue of one
            if prefill is None:
                maybe = [self._local(view, request, d, now, full_ok=True) for d in roomy]
            else:
                maybe = [
                    self._candidate(d, now + prefill.ttft_s, now, request.prompt_len, full_ok=True)
                    for d in roomy
                ]
            cands = [c for c in maybe if c is not None]
        if not cands:
            return self._reject(
                request,
                RejectCause.NO_CAPACITY,
                "every decode instance with free KV blocks has a full batch when the prefill ends",
                self._next_departure(roomy, now, now if prefill is None else now + prefill.ttft_s),
            )
        decode = self.choose_decode(cands)
        if prefill is not None and self.options.disagg_threshold > 0:
            local = self._local(view, request, decode.view, now)
            if local is not None:
                assert local.local is not None
                left = uncached_tokens(request, local.local.reach, view.block_size)
                if left <= self.options.disagg_threshold:
                    decode, prefill = local, None
                    note = f"{left} uncached tokens <= disagg_threshold {self.options.disagg_threshold}"
        return self._judge(request, prefill, decode, now, note)

    # ------------------------------------------------------------------ steps

    def _choose_prefill(self, view: ClusterView, request: RequestView) -> tuple[Estimate | None, str]:
        if not view.prefills:
            return None, "no prefill instance is live"
        fits: list[Estimate] = []
        for p in _by_id(view.prefills):
            est = estimate(
                view,
                request,
                p.instance_id,
                p.cached,
                p.bandwidth_bps,
                queue_time(p, self.costs),
                self.costs,
                self.options.balancing_threshold,
            )
            if prefill_blocks(request, est.plan, view.block_size) <= p.free_blocks:
                fits.append(est)
        if not fits:
            return None, "no prefill instance has free KV blocks for it"
        return self.choose_prefill(fits), "prefill and decode disaggregated"

    def _candidate(
        self,
        d: DecodeView,
        ready: float,
        now: float,
        prompt_len: int,
        local: Estimate | None = None,
        full_ok: bool = False,
    ) -> DecodeCandidate | None:
        step = step_now(d, self.costs.decode)
        load = load_at(d, max(ready, now), now, step)
        if load.batch_size >= d.max_batch and not full_ok:
            return None
        return DecodeCandidate(d, ready, load, tbt_with(load, prompt_len, self.costs.decode), step, local)

    def _local(
        self, view: ClusterView, request: RequestView, d: DecodeView, now: float, full_ok: bool = False
    ) -> DecodeCandidate | None:
        """``d`` prefilling the request itself: the step it runs now is its queue."""
        wait = step_now(d, self.costs.decode) if d.running else 0.0
        est = estimate(
            view,
            request,
            d.instance_id,
            d.cached,
            d.bandwidth_bps,
            wait,
            self.costs,
            self.options.balancing_threshold,
        )
        return self._candidate(d, now + est.ttft_s, now, request.prompt_len, est, full_ok)

    def _judge(
        self, request: RequestView, prefill: Estimate | None, decode: DecodeCandidate, now: float, note: str
    ) -> Placement | Rejection:
        chosen = prefill if prefill is not None else decode.local
        assert chosen is not None  # a decode candidate without a prefill always carries its local estimate
        ttft, tbt = chosen.ttft_s, decode.tbt_s
        where = (
            f"prefill {chosen.instance_id}"
            if prefill is not None
            else f"local prefill on {decode.instance_id}"
        )
        slo_ttft, slo_tbt = self.options.slo_ttft_s, self.options.slo_tbt_s
        if not self.costs.prefill.calibrated:
            slo_ttft = None  # no measurements yet: a guess must not turn requests away
        if not self.costs.decode.calibrated:
            slo_tbt = None
        if slo_ttft is not None and ttft > slo_ttft:
            floor = chosen.transfer_s + chosen.prefill_s
            retry = RETRY_MAX_S if floor > slo_ttft else ttft - slo_ttft  # the queue drains in real time
            return self._reject(
                request,
                RejectCause.TTFT_SLO,
                f"predicted TTFT {ttft:.3f}s > SLO {slo_ttft:.3f}s on the best placement ({where}; "
                f"{chosen.summary()})",
                retry,
                ttft,
                tbt,
            )
        if slo_tbt is not None and tbt > slo_tbt:
            wait = tbt_retry_after(
                decode.view,
                decode.ready_at_s,
                now,
                decode.step_s,
                request.prompt_len,
                slo_tbt,
                self.costs.decode,
            )
            return self._reject(
                request,
                RejectCause.TBT_SLO,
                f"predicted TBT {tbt:.4f}s > SLO {slo_tbt:.4f}s on decode {decode.instance_id} at "
                f"batch {decode.load.batch_size + 1} when the prefill ends",
                RETRY_MAX_S if wait is None else wait,
                ttft,
                tbt,
            )
        reason = (
            f"{self.name}: {where} ({chosen.summary()}); decode {decode.instance_id} (tbt {tbt:.4f}s at "
            f"batch {decode.load.batch_size + 1} when the prefill ends); {note}"
        )
        return Placement(
            request_id=request.request_id,
            prefill_id=None if prefill is None else prefill.instance_id,
            decode_id=decode.instance_id,
            plan=chosen.plan,
            ttft_s=ttft,
            tbt_s=tbt,
            ready_at_s=now + ttft,
            policy=self.name,
            reason=reason,
        )

    def _next_departure(self, decodes: Sequence[DecodeView], now: float, after: float) -> float:
        """Seconds from ``after`` to the first predicted departure after it on any of ``decodes``."""
        times = [t for d in decodes for t in departures(d, now, step_now(d, self.costs.decode)) if t > after]
        return min(times) - after if times else RETRY_MAX_S

    def _reject(
        self,
        request: RequestView,
        cause: RejectCause,
        reason: str,
        retry_s: float,
        ttft_s: float | None = None,
        tbt_s: float | None = None,
    ) -> Rejection:
        return Rejection(
            request_id=request.request_id,
            cause=cause,
            reason=f"{self.name}: {reason}",
            retry_after_s=clamp_retry(retry_s),
            policy=self.name,
            ttft_s=ttft_s,
            tbt_s=tbt_s,
        )


class _Instance(Protocol):
    @property
    def instance_id(self) -> str: ...


_I = TypeVar("_I", bound=_Instance)


def _by_id(items: Sequence[_I]) -> list[_I]:
    return sorted(items, key=lambda i: i.instance_id)
