"""Per-instance estimates: the prefix plan an instance would follow and the TTFT it predicts.

The prefix plan is where Algorithm 1's balancing threshold meets the paper's Eq. 2:

1. Match: ``local`` blocks from the instance's cache, ``reach`` with the store's run after them
   (``yutu.sched.prefix``).
2. Balancing threshold (when to consider a fetch at all): only when ``reach > local`` and
   ``reach / local > balancing_threshold`` (always when ``local == 0``).
3. Eq. 2 (whether the fetch pays), online, per request: fetch blocks ``[local, reach)`` only when the
   predicted transfer time is below the prefill time it saves,
   ``transfer(reach - local) < prefill(L, local*bs) - prefill(L, reach*bs)``; else recompute them.

Fetching all of ``[local, reach)`` or none is exact under the cost models: with prefill
``a + b*n + c*(L^2 - p^2)`` (``n*(L+p) = L^2 - p^2``) the time saved is convex in the fetched length
and the transfer time is affine in it, so their difference peaks at an end of the range.

TTFT on a prefill instance = queue (predicted compute of everything queued there that runs before
the request) + transfer + prefill, as in Algorithm 1 (no overlap assumed). What runs before it: the
prompts the engine admitted, then the waiting ones of its priority or a lower value (the engines
serve by priority, then first come first served). On a decode instance prefilling locally, the
queue is the step it is running now (the prompt's chunk rides the next step) and the prefills it
already took on that run before the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from yutu.sched.costs import CostModels
from yutu.sched.outcome import PrefixPlan
from yutu.sched.prefix import cdiv, match, usable_blocks
from yutu.sched.view import ClusterView, KeySet, QueuedPrefill, RequestView


@dataclass(frozen=True)
class Estimate:
    """What running the request's prefill on one instance would cost."""

    instance_id: str
    plan: PrefixPlan
    reach: int  # blocks reachable without computing (local + store run); plan.fetch_end <= reach
    queue_s: float
    transfer_s: float
    prefill_s: float
    decision: str  # why the plan fetches or recomputes, for the placement's reason

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s

    def summary(self) -> str:
        p = self.plan
        return (
            f"ttft {self.ttft_s:.3f}s = queue {self.queue_s:.3f} + transfer {self.transfer_s:.3f} + prefill "
            f"{self.prefill_s:.3f}; reuse {p.local_blocks} local + {p.fetch_blocks} store blocks, "
            f"compute {p.compute_tokens} tokens ({self.decision})"
        )


def plan_prefix(
    view: ClusterView,
    request: RequestView,
    cached: KeySet,
    bandwidth_bps: float | None,
    costs: CostModels,
    balancing_threshold: float,
) -> tuple[PrefixPlan, int, float, str]:
    """``(plan, reach, transfer_s, decision)`` for an instance holding ``cached`` (module docstring)."""
    bs, length = view.block_size, request.prompt_len
    usable = usable_blocks(length, bs, len(request.block_keys))
    local, reach = match(request.block_keys, cached, view.store, usable)
    end, transfer_s = local, 0.0
    if reach == local:
        decision = "nothing more in the store"
    elif local > 0 and reach / local <= balancing_threshold:
        decision = f"store's {reach - local} more blocks within the balancing threshold"
    else:
        transfer = costs.transfer.predict((reach - local) * view.bytes_per_block, bandwidth_bps)
        saved = costs.prefill.predict(length, local * bs) - costs.prefill.predict(length, reach * bs)
        if transfer < saved:
            end, transfer_s = reach, transfer
            decision = f"fetch: {transfer:.4f}s < {saved:.4f}s saved"
        else:
            decision = f"recompute: fetch {transfer:.4f}s >= {saved:.4f}s saved"
    plan = PrefixPlan(local_blocks=local, fetch_end=end, compute_tokens=length - end * bs)
    return plan, reach, transfer_s, decision


def queue_time(queue: Sequence[QueuedPrefill], costs: CostModels, priority: int = 0) -> float:
    """Predicted compute time of the prefills of ``queue`` (an instance's, queued or running) that run
    before a request of ``priority`` placed there now."""
    return sum(
        costs.prefill.predict(q.prompt_len, q.done_tokens)
        for q in queue
        if q.done_tokens < q.prompt_len and q.runs_before(priority)
    )


def estimate(
    view: ClusterView,
    request: RequestView,
    instance_id: str,
    cached: KeySet,
    bandwidth_bps: float | None,
    queue_s: float,
    costs: CostModels,
    balancing_threshold: float,
) -> Estimate:
    """The estimate for one instance whose queue takes ``queue_s``."""
    plan, reach, transfer_s, decision = plan_prefix(
        view, request, cached, bandwidth_bps, costs, balancing_threshold
    )
    prefill_s = costs.prefill.predict(request.prompt_len, plan.fetch_end * view.block_size)
    return Estimate(instance_id, plan, reach, queue_s, transfer_s, prefill_s, decision)


def prefill_blocks(request: RequestView, plan: PrefixPlan, block_size: int) -> int:
    """Blocks an instance must allocate to prefill the request: all but its locally reused ones."""
    return cdiv(request.prompt_len, block_size) - plan.local_blocks


def uncached_tokens(request: RequestView, reach: int, block_size: int) -> int:
    """Prompt tokens neither the instance's cache nor the store can supply."""
    return request.prompt_len - reach * block_size
