"""The placement steps every policy shares; a policy only says which prefill and which decode it prefers.

``Placer.place(view, request, now)``, in order:

1. No decode instance live: Rejection NO_DECODE (503).
2. Prefill: estimate every prefill instance (prefix plan with fetch-or-recompute, queue, TTFT:
   ``yutu.sched.estimate``), drop those without free blocks for the blocks they would allocate, and
   let the policy choose (``choose_prefill``). None live: the decode prefills. None with room: a
   decode prefills it only where that stalls nobody's decode past the TBT SLO (see "Overflow");
   otherwise it queues on the policy's choice among all prefill instances (their blocks free as
   their queues drain; the TTFT check judges the wait).
3. Decode: forecast each decode when the request joins it, its KV handed over after the prefill
   (``yutu.sched.forecast``; the forecast's constant step is today's, or the step of the heaviest
   forecast batch when that is longer: the others then leave later too): drop those without
   ``ceil((L + 1) / bs)`` blocks free then (running sequences that will have left give theirs back;
   incoming requests take theirs) or whose batch would be full, and let the policy choose
   (``choose_decode``). None left: Rejection NO_CAPACITY -- with an SLO set. Without one, nothing
   is turned away: the request goes where it would wait least (it queues there).
4. Conditional disaggregation: when at most ``disagg_threshold`` prompt tokens remain uncached after
   the chosen decode's own cache and the store, that decode prefills them itself.
5. Prefill stealing (``prefill_stealing``, off by default): otherwise, when the chosen prefill instance
   has a queue and the chosen decode would finish the prefill itself sooner (its own step and the
   prefills it already took on are its queue), the decode takes it -- if the time saved exceeds the
   delay it adds to the sequences decoding there (their number when it starts times its prefill
   time) and, under a TBT SLO, the stall fits the SLO as in "Overflow". Dynamo's disaggregated
   router makes the same call with a fixed bound (remote only while the prefill queue is short);
   here the cost models judge it. It trades the TBT tail (and work on a decode that may be the
   bottleneck) for TTFT: measured in docs/architecture.md, hence off by default (``yutu up``, whose
   instances share one host's cores, turns it on).
6. Early rejection: a predicted TTFT (what the request already waited before placement, then
   queue + transfer + prefill) above ``slo_ttft_s`` or TBT above ``slo_tbt_s`` rejects the
   request with a ``retry_after_s`` estimate -- once the cost model behind the prediction is
   calibrated (measured, or a trusted prior). The TBT is the one of the heaviest batch forecast over
   the request's decode lifetime (committed placements that arrive while it decodes included).

Overflow: a decode instance prefilling a prompt stalls its running batch. Unchunked
(``DecodeView.chunk_tokens`` None, the simulator) the whole prefill rides one step; chunked (a real
worker, its ``max_num_batched_tokens``) each step carries one chunk, the last and dearest costing
``prefill(L, L - chunk)``. A decode is affordable for an overflow prefill when nothing runs there
when it starts, or when its step plus that stall stays within the TBT SLO (calibrated models only).

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
    free_blocks_at,
    load_at,
    peak_load,
    step_now,
    tbt_retry_after,
    tbt_with,
    with_handoffs,
)
from yutu.sched.options import PolicyOptions
from yutu.sched.outcome import RETRY_MAX_S, Placement, RejectCause, Rejection, clamp_retry
from yutu.sched.prefix import cdiv
from yutu.sched.view import ClusterView, DecodeView, RequestView

NO_DECODE_RETRY_S = 5.0  # a replacement decode instance registers within seconds
NO_ROOM = "no prefill instance has free KV blocks for it"


@dataclass(frozen=True)
class DecodeCandidate:
    """A decode instance as the policy weighs it: its forecast load while the request decodes."""

    view: DecodeView
    ready_at_s: float  # when the request's prefill is predicted to end
    joins_at_s: float  # when it is predicted to join the batch (its KV handed over)
    load: DecodeLoad  # the heaviest forecast batch of its decode lifetime, before it joins
    tbt_s: float  # predicted TBT in that batch, the request included
    step_s: float  # the step time at today's load the forecast used
    joins: DecodeLoad  # forecast batch at ready_at_s, when it joins
    free_blocks: int  # forecast free blocks at ready_at_s (may be negative)
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
        decodes = _by_id(view.decodes)
        prefill, note, waiting = self._choose_prefill(view, request)
        built: list[DecodeCandidate] = []
        if prefill is None:
            maybe = [self._local(view, request, d, now, overflow=bool(waiting)) for d in decodes]
            built = [c for c in maybe if c is not None]
            if not built and waiting and self.options.slo_ttft_s is not None:
                # Its prefill would wait for blocks to free, which no cost model forecasts: under a
                # TTFT SLO that is a promise the conductor cannot make, so say so now (429).
                return self._reject(
                    request,
                    RejectCause.NO_CAPACITY,
                    f"{NO_ROOM}, and no decode instance can take its prefill's stall",
                    min(e.ttft_s for e in waiting),
                )
            if not built:  # no decode can afford the prefill's stall: queue on a prefill instance
                prefill = self.choose_prefill(waiting)
                note = f"{NO_ROOM}: queued there, as no decode instance can take its prefill's stall"
        if prefill is not None:
            built = [self._candidate(view, request, d, now + prefill.ttft_s, now) for d in decodes]
        need = decode_blocks(request.prompt_len, view.block_size)
        roomy = [c for c in built if c.free_blocks >= need]
        cands = [c for c in roomy if c.joins.batch_size < c.view.max_batch]
        if not cands and self.options.slo_ttft_s is None and self.options.slo_tbt_s is None:
            # Without an SLO nothing is turned away: wait for a slot, else for blocks, on one.
            with_slot = [c for c in built if c.joins.batch_size < c.view.max_batch]
            cands = roomy or with_slot or built
        if not cands:
            return self._no_capacity(request, built, roomy, need, now)
        decode = self.choose_decode(cands)
        if prefill is not None and (self.options.disagg_threshold > 0 or self.options.prefill_stealing):
            here = self._local(view, request, decode.view, now)
            assert here is not None and here.local is not None
            left = uncached_tokens(request, here.local.reach, view.block_size)
            if left <= self.options.disagg_threshold:
                decode, prefill = here, None
                note = f"{left} uncached tokens <= disagg_threshold {self.options.disagg_threshold}"
            elif self.options.prefill_stealing and self._steals(view, request, prefill, here, need, now):
                note = (
                    f"stolen from the queue of prefill {prefill.instance_id} (ttft {prefill.ttft_s:.3f}s "
                    f"there; queue {prefill.queue_s:.3f}s)"
                )
                decode, prefill = here, None
        return self._judge(request, prefill, decode, now, note)

    # ------------------------------------------------------------------ steps

    def _choose_prefill(
        self, view: ClusterView, request: RequestView
    ) -> tuple[Estimate | None, str, list[Estimate]]:
        """``(chosen, note, waiting)``: the policy's choice among prefill instances with room, or None
        with ``waiting`` = every live one's estimate when none has room (empty when none is live)."""
        if not view.prefills:
            return None, "no prefill instance is live", []
        fits: list[Estimate] = []
        every: list[Estimate] = []
        for p in _by_id(view.prefills):
            est = estimate(
                view,
                request,
                p.instance_id,
                p.cached,
                p.bandwidth_bps,
                queue_time(p.queue, self.costs, request.priority),
                self.costs,
                self.options.balancing_threshold,
            )
            every.append(est)
            if prefill_blocks(request, est.plan, view.block_size) <= p.free_blocks:
                fits.append(est)
        if not fits:
            return None, NO_ROOM, every
        return self.choose_prefill(fits), "prefill and decode disaggregated", []

    def _candidate(
        self,
        view: ClusterView,
        request: RequestView,
        d: DecodeView,
        ready: float,
        now: float,
        local: Estimate | None = None,
    ) -> DecodeCandidate:
        """The forecast for ``d`` when the request's prefill ends at ``ready`` (module docstring, 3)."""
        model = self.costs.decode

        def handoff(prompt_len: int) -> float:
            return self.costs.transfer.predict(cdiv(prompt_len, view.block_size) * view.bytes_per_block)

        d = with_handoffs(d, handoff)
        start = max(ready if local is not None else ready + handoff(request.prompt_len), now)
        step = step_now(d, model)
        peak = peak_load(d, start, request.max_tokens, request.prompt_len, now, step, model)
        tbt = tbt_with(peak, request.prompt_len, model)
        if tbt > step:  # the others decode at the heavier step too, and leave later: forecast again
            step = tbt
            peak = peak_load(d, start, request.max_tokens, request.prompt_len, now, step, model)
            tbt = tbt_with(peak, request.prompt_len, model)
        joins = load_at(d, start, now, step)
        free = free_blocks_at(d, start, now, step, view.block_size)
        return DecodeCandidate(d, ready, start, peak, tbt, step, joins, free, local)

    def _local(
        self, view: ClusterView, request: RequestView, d: DecodeView, now: float, overflow: bool = False
    ) -> DecodeCandidate | None:
        """``d`` prefilling the request itself: the step it runs now and the prefills it took on are
        its queue. With ``overflow`` (a prefill instance could take it instead): None unless ``d`` can
        afford the stall."""
        stepping = step_now(d, self.costs.decode) if d.running else 0.0
        wait = stepping + queue_time(d.prefills, self.costs, request.priority)
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
        if overflow and not self._affords(view, request, d, est, now):
            return None
        return self._candidate(view, request, d, now + est.ttft_s, now, est)

    def _steals(
        self,
        view: ClusterView,
        request: RequestView,
        prefill: Estimate,
        here: DecodeCandidate,
        need: int,
        now: float,
    ) -> bool:
        """Whether ``here`` takes the prefill off ``prefill``'s queue (module docstring, 5)."""
        est = here.local
        assert est is not None
        saved = prefill.ttft_s - est.ttft_s
        if prefill.queue_s <= 0 or saved <= 0:
            return False
        if here.free_blocks < need or here.joins.batch_size >= here.view.max_batch:
            return False
        d = here.view
        running = load_at(d, now + est.queue_s, now, step_now(d, self.costs.decode))
        compute = est.prefill_s if d.chunk_tokens is not None else est.transfer_s + est.prefill_s
        if running.batch_size * compute >= saved:
            return False
        return self.options.slo_tbt_s is None or self._affords(view, request, d, est, now)

    def _affords(
        self, view: ClusterView, request: RequestView, d: DecodeView, est: Estimate, now: float
    ) -> bool:
        """Whether ``d``'s running batch can carry the prefill of ``est`` (module docstring, Overflow)."""
        model = self.costs.decode
        start = now + est.queue_s
        running = load_at(d, start, now, step_now(d, model))
        if running.batch_size == 0:
            return True
        slo = self.options.slo_tbt_s
        if slo is None or not model.calibrated or not self.costs.prefill.calibrated:
            return False
        if d.chunk_tokens is None:
            stall = est.transfer_s + est.prefill_s
        else:
            length = request.prompt_len
            last = max(est.plan.fetch_end * view.block_size, length - d.chunk_tokens)
            stall = self.costs.prefill.predict(length, last)
        return model.predict(running.batch_size, running.kv_tokens) + stall <= slo

    def _no_capacity(
        self,
        request: RequestView,
        built: Sequence[DecodeCandidate],
        roomy: Sequence[DecodeCandidate],
        need: int,
        now: float,
    ) -> Rejection:
        after = max((c.ready_at_s for c in built), default=now)
        retry = self._next_departure([c.view for c in built], now, after)
        if not roomy:
            most = max((c.free_blocks for c in built), default=0)
            return self._reject(
                request,
                RejectCause.NO_CAPACITY,
                f"no decode instance has {need} free KV blocks for a {request.prompt_len}-token prompt "
                f"when its prefill ends (most free: {max(0, most)})",
                retry,
            )
        return self._reject(
            request,
            RejectCause.NO_CAPACITY,
            "every decode instance with free KV blocks has a full batch when the prefill ends",
            retry,
        )

    def _judge(
        self, request: RequestView, prefill: Estimate | None, decode: DecodeCandidate, now: float, note: str
    ) -> Placement | Rejection:
        chosen = prefill if prefill is not None else decode.local
        assert chosen is not None  # a decode candidate without a prefill always carries its local estimate
        ttft, tbt = request.waited_s + chosen.ttft_s, decode.tbt_s
        where = (
            f"prefill {chosen.instance_id}"
            if prefill is not None
            else f"local prefill on {decode.instance_id}"
        )
        if request.waited_s:
            where += f"; {request.waited_s:.3f}s waited before placement"
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
                decode.joins_at_s,
                now,
                decode.step_s,
                request.prompt_len,
                request.max_tokens,
                slo_tbt,
                self.costs.decode,
            )
            return self._reject(
                request,
                RejectCause.TBT_SLO,
                f"predicted TBT {tbt:.4f}s > SLO {slo_tbt:.4f}s on decode {decode.instance_id} at "
                f"batch {decode.load.batch_size + 1}, the heaviest forecast while it decodes",
                RETRY_MAX_S if wait is None else wait,
                ttft,
                tbt,
            )
        reason = (
            f"{self.name}: {where} ({chosen.summary()}); decode {decode.instance_id} (tbt {tbt:.4f}s at "
            f"batch {decode.load.batch_size + 1}, the heaviest while it decodes); {note}"
        )
        return Placement(
            request_id=request.request_id,
            prefill_id=None if prefill is None else prefill.instance_id,
            decode_id=decode.instance_id,
            plan=chosen.plan,
            ttft_s=ttft,
            tbt_s=tbt,
            ready_at_s=now + chosen.ttft_s,
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
